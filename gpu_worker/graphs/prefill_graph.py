"""`PrefillGraphs`: short prefills of the target replayed as CUDA graphs, bucketed by tokens.

An eager forward launches every kernel from Python, hundreds of them, so the prefill of a
short prompt costs the host many times its GPU work, and a request's first token waits for
it. Decode steps are graphs already; this does the same for EXTEND forwards of up to `max_tokens`
tokens (`--cuda-graph-max-prefill-tokens`).

A bucket is a token count T (16, 32, 64, ... up to max_tokens) with room for R = min(T,
MAX_REQUESTS) requests. Its static inputs live in one packed int64 buffer that a single copy
from pinned memory fills: [input_ids | positions | out_cache_loc] for T tokens and
[rows | seq_lens | extend_seq_lens] for R requests. A batch of n tokens and bs
requests runs in the smallest bucket with T >= n and R >= bs; its padding:
- tokens n .. T: id 0 at position 0, KV slot 0 (the reserved dummy slot); they belong to no
  request, so nothing attends them and their outputs are never read;
- requests bs .. R: row 0, seq_len 0 and extend_len 0: the extend attention kernel returns
  at once for them, and their logits (those of token n - 1) are never read.
Under capture the attention metadata sees a longest extend of T tokens, so the kernel's grid
covers any request the bucket can hold; kernels read every length from the device.

`run` returns a `ForwardBatch` of the real batch (views of the static inputs, with the
plan's host lengths) and the outputs as views of static buffers: each request's last-token
logits and, with `keep_hidden` (speculation: the draft's prefill reads them), every token's
hidden and aux hidden states. Views stay valid until the next `run`; all work is ordered on
one stream, so a later run's input copy waits for the kernels that read the previous one.

Without capture (tests on CPU) the same buffers, padding and output copies run eagerly, with
the capture's host lengths (the reference backend, which plans from host lengths, gets the
batch's own).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.graphs.cuda_graph import capture_buckets, copy_kept, graph_body
from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode, make_batch
from gpu_worker.step.host_batch import HostBatch, Staging

if TYPE_CHECKING:
    from gpu_worker.model_runner import LogitsOutput, ModelRunner
    from gpu_worker.models import ArchConfig


MIN_TOKENS = 16  # the smallest bucket
MAX_REQUESTS = 64  # requests one bucket holds at most


def token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_TOKENS, and max_tokens itself (empty when max_tokens < 1)."""
    if max_tokens < 1:
        return []
    buckets = {max_tokens}
    t = MIN_TOKENS
    while t < max_tokens:
        buckets.add(t)
        t *= 2
    return sorted(buckets)


def requests_for(tokens: int) -> int:
    """Requests a bucket of `tokens` tokens holds."""
    return min(tokens, MAX_REQUESTS)


def graph_bytes(config: ArchConfig, max_tokens: int, dtype: torch.dtype) -> int:
    """Device memory the prefill graphs of up to max_tokens tokens may take (kept out of the
    KV budget): the largest bucket's activations with room to spare, the static hidden and
    aux outputs (counted even when not kept) and float32 logits."""
    if max_tokens < 1:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    hidden, inter = config.hidden_size, config.intermediate_size
    activations = max_tokens * (2 * inter + 8 * hidden) * element
    logits = requests_for(max_tokens) * config.vocab_size * 4 * 2  # static + the forward's
    outputs = max_tokens * 4 * hidden * element
    return 4 * activations + logits + outputs + (32 << 20)


class PrefillGraphs:
    def __init__(
        self, runner: ModelRunner, max_tokens: int, capture: bool, keep_hidden: bool = False
    ) -> None:
        """capture: record graphs (CUDA, a backend that can be captured); else run the same
        padded path eagerly. keep_hidden: keep every token's hidden (and aux) states too."""
        self.runner = runner
        self.buckets = token_buckets(max_tokens)
        if not self.buckets:
            raise ValueError("prefill graphs need max_tokens >= 1")
        self.max_tokens = self.buckets[-1]
        self.max_requests = requests_for(self.max_tokens)
        self.captures = capture
        self.kept = ("next_token_logits",) + (
            ("hidden_states", "aux_hidden_states") if keep_hidden else ()
        )
        n, r = self.max_tokens, self.max_requests
        device = runner.device
        self.packed = torch.zeros(3 * n + 3 * r, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = self.packed[: 3 * n].view(3, n)
        self.rows, self.seq_lens, self.extend_seq_lens = self.packed[3 * n :].view(3, r)
        self.staging = Staging(device, capacity=self.packed.numel())
        self.outputs: LogitsOutput | None = None  # static, allocated by the first forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self.capture_all()

    # ------------------------------------------------------------------------------ use

    def bucket_for(self, num_tokens: int, batch_size: int) -> int | None:
        """The smallest bucket that holds the batch, or None."""
        return next(
            (t for t in self.buckets if t >= num_tokens and requests_for(t) >= batch_size), None
        )

    def can_run(self, host: HostBatch) -> bool:
        return (
            host.mode == ForwardMode.EXTEND
            and host.batch_size > 0
            and self.bucket_for(len(host.input_ids), host.batch_size) is not None
        )

    def run(self, host: HostBatch) -> tuple[ForwardBatch, LogitsOutput]:
        """Forward `host` (can_run must hold) in its bucket: (the real batch, output views)."""
        n, bs = len(host.input_ids), host.batch_size
        bucket = self.bucket_for(n, bs)
        assert bucket is not None
        r = requests_for(bucket)
        self._fill(host)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
        elif self.runner.attn_backend.reads_host_lengths:  # the reference backend: real ones
            lens = [*host.seq_lens.tolist(), *[0] * (r - bs)]
            extend = [*host.extend_seq_lens.tolist(), *[0] * (r - bs)]
            self._forward(self._static_batch(bucket, lens, extend))
        else:  # eagerly, exactly as captured: the host lengths only size the grid
            self._forward(self._static_batch(bucket, [bucket] * r, [bucket] * r))
        real = make_batch(
            ForwardMode.EXTEND,
            self.input_ids[:n],
            self.positions[:n],
            self.out_cache_loc[:n],
            self.rows[:bs],
            host.seq_lens.tolist(),
            host.extend_seq_lens.tolist(),
            seq_lens=self.seq_lens[:bs],
            extend_seq_lens=self.extend_seq_lens[:bs],
        )
        return real, self._output_views(n, bs)

    def _fill(self, host: HostBatch) -> None:
        """One copy of the batch, padded to the largest bucket, into the static inputs."""
        n, r = self.max_tokens, self.max_requests

        def padded(values: np.ndarray, size: int) -> np.ndarray:
            return np.concatenate((values, np.zeros(size - len(values), np.int64)))

        self.staging.upload_into(
            self.packed,
            [
                padded(host.input_ids, n),
                padded(host.positions, n),
                padded(host.out_cache_loc, n),
                padded(host.rows, r),
                padded(host.seq_lens, r),
                padded(host.extend_seq_lens, r),
            ],
        )

    # ------------------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        def run(tokens: int) -> None:
            # The host lengths only size the attention grid: a longest extend of the whole
            # bucket covers any request it holds.
            r = requests_for(tokens)
            self._forward(self._static_batch(tokens, [tokens] * r, [tokens] * r))

        self.graphs = capture_buckets(self.buckets, run, self.runner.device, "prefill, tokens")

    def _static_batch(
        self, tokens: int, seq_lens_cpu: list[int], extend_cpu: list[int]
    ) -> ForwardBatch:
        r = requests_for(tokens)
        return make_batch(
            ForwardMode.EXTEND,
            self.input_ids[:tokens],
            self.positions[:tokens],
            self.out_cache_loc[:tokens],
            self.rows[:r],
            seq_lens_cpu,
            extend_cpu,
            seq_lens=self.seq_lens[:r],
            extend_seq_lens=self.extend_seq_lens[:r],
        )

    def _forward(self, batch: ForwardBatch) -> None:
        """The captured work: metadata, the model, and copies into the static outputs."""
        out = graph_body(self.runner, batch, self.captures)
        if self.outputs is None:
            self.outputs = self._allocate_outputs(out)
        copy_kept(out, self.outputs, self.kept)

    def _allocate_outputs(self, out: LogitsOutput) -> LogitsOutput:
        """Static outputs for the largest bucket, shaped like out."""

        def like(name: str, rows: int) -> torch.Tensor | None:
            t = getattr(out, name)
            if t is None or name not in self.kept:
                return None
            return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)

        return dataclasses.replace(
            out,
            next_token_logits=like("next_token_logits", self.max_requests),
            hidden_states=like("hidden_states", self.max_tokens),
            aux_hidden_states=like("aux_hidden_states", self.max_tokens),
        )

    def _output_views(self, num_tokens: int, batch_size: int) -> LogitsOutput:
        assert self.outputs is not None
        out = self.outputs

        def head(t: torch.Tensor | None, count: int) -> torch.Tensor | None:
            return None if t is None else t[:count]

        return dataclasses.replace(
            out,
            next_token_logits=out.next_token_logits[:batch_size],
            hidden_states=head(out.hidden_states, num_tokens),
            aux_hidden_states=head(out.aux_hidden_states, num_tokens),
        )
