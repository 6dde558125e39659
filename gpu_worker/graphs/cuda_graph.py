"""`CudaGraphRunner`: one generic runner that replays a ModelRunner's forward as CUDA graphs.

A graph replays a fixed sequence of kernels on fixed buffers, so everything a forward reads
lives in static buffers sized for the largest batch: the integer inputs (token ids,
positions, KV slots, request rows, seq_lens) are views into ONE packed device buffer that a
single copy from pinned host memory fills (`Staging.upload_into`), and the outputs (logits,
hidden states, aux hidden states) are copied into static output buffers at the end of the
forward. A batch of `bs` requests runs in the smallest captured bucket >= bs; the padded rows
point at request row 0 and KV slot 0 (the reserved dummies) with `seq_lens` = the backend's
fill value, so they read and write only the dummy slot.

Capture: buckets largest first, one shared memory pool, two eager warm-up runs before each
capture (Triton compiles, cuBLAS picks its kernels); the attention backend prepares its
metadata through `init_forward_metadata_capture` (`init_forward_metadata_replay` before each
replay). Capture time and memory are logged.

Without capture (CPU, or a backend that cannot be captured) the same buffers, padding and
output copies run eagerly, so CI covers everything but the replay itself.

Each instance serves one mode with a fixed number of tokens per request (DECODE: 1). The
outputs returned by `run` are views of the static buffers: read them before the next `run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from gpu_worker.step.forward_batch import ForwardBatch, ForwardMode, make_batch
from gpu_worker.step.host_batch import HostBatch, Staging

if TYPE_CHECKING:
    from gpu_worker.model_runner import LogitsOutput, ModelRunner

log = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off while a graph is captured. A collection that
    frees an unreachable CUDAGraph (an earlier worker's, in a process that builds several)
    destroys its executable graph, which is not permitted while a stream captures: the capture
    is invalidated and fails later with "operation failed due to a previous error during
    capture", at whichever kernel comes next, as often or as rarely as collections happen to
    run during captures. `torch.cuda.graph` collects once before it starts capturing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_buckets(
    buckets: list[int], run: Callable[[int], None], device: torch.device, what: str, pool=None
) -> dict[int, torch.cuda.CUDAGraph]:
    """A CUDA graph of run(bucket) for every bucket: largest first (it allocates the static
    outputs; the smaller ones reuse its memory), each after NUM_WARMUP_RUNS eager runs on the
    capture stream (Triton compiles, cuBLAS picks its kernels), all in one memory pool (`pool`,
    or a new one). Logs the time and memory they took; what: e.g. "decode step, batch sizes"."""
    start = time.perf_counter()
    reserved = torch.cuda.memory_reserved(device)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    for bucket in reversed(buckets):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(NUM_WARMUP_RUNS):
                run(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream), no_collection():
            run(bucket)
        graphs[bucket] = graph
    torch.cuda.synchronize(device)
    log.info(
        "captured %d CUDA graphs (%s %d..%d) in %.1f s, %.0f MiB",
        len(graphs),
        what,
        buckets[0],
        buckets[-1],
        time.perf_counter() - start,
        (torch.cuda.memory_reserved(device) - reserved) / 2**20,
    )
    return graphs


def graph_body(runner: ModelRunner, batch: ForwardBatch, capturing: bool) -> LogitsOutput:
    """What a graph of runner's forward captures: the attention metadata (the backend's
    capture variant while capturing) and the model."""
    backend = runner.attn_backend
    if capturing:
        metadata = backend.init_forward_metadata_capture(batch)
    else:
        metadata = backend.init_forward_metadata(batch)
    batch = dataclasses.replace(batch, attn_backend=backend, attn_metadata=metadata)
    return runner.run_model(batch)


def copy_kept(out: LogitsOutput, static: LogitsOutput, names: tuple[str, ...]) -> None:
    """Copy the named outputs of a forward into the leading rows of the static ones."""
    for name in names:
        src = getattr(out, name)
        if src is not None:
            getattr(static, name)[: src.shape[0]].copy_(src)


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return sorted({*small, *range(8, max_bs + 1, 8), max_bs})


class CudaGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        max_bs: int,
        mode: ForwardMode = ForwardMode.DECODE,
        tokens_per_req: int = 1,
        capture: bool | None = None,
        keep_hidden: bool = False,
    ) -> None:
        """capture: record graphs (default: on CUDA); else run the same path eagerly.
        keep_hidden: also keep the hidden (and aux) states; plain decode needs only logits."""
        self.runner = runner
        self.outputs_kept = ("next_token_logits",) + (
            ("hidden_states", "aux_hidden_states") if keep_hidden else ()
        )
        self.mode = mode
        self.tokens_per_req = tokens_per_req
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device = runner.device
        self.captures = device.type == "cuda" if capture is None else capture
        n, rows = self.max_bs * tokens_per_req, self.max_bs
        fill = runner.attn_backend.cuda_graph_seq_len_fill_value
        # [ids | positions | out_cache_loc | rows | seq_lens], one copy fills all
        self.packed = torch.zeros(3 * n + 2 * rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_cache_loc = self.packed[: 3 * n].view(3, n)
        self.rows = self.packed[3 * n : 3 * n + rows]
        self.seq_lens = self.packed[3 * n + rows :]
        self.seq_lens.fill_(fill)
        self.extend_seq_lens = torch.full((rows,), tokens_per_req, dtype=torch.int64, device=device)
        self._pad = {
            "ids": np.zeros(n, np.int64),
            "rows": np.zeros(rows, np.int64),
            "seq_lens": np.full(rows, fill, np.int64),
        }
        self.staging = Staging(device, capacity=self.packed.numel())
        self.outputs: LogitsOutput | None = None  # static, allocated by the first forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._batches = {bs: self._static_batch(bs) for bs in self.buckets}
        if self.captures:
            runner.attn_backend.init_cuda_graph_state(self.max_bs, tokens_per_req)
            self.capture_all()

    # ------------------------------------------------------------------------------ use

    def can_run(self, host: HostBatch) -> bool:
        return (
            host.mode == self.mode
            and 0 < host.batch_size <= self.max_bs
            and len(host.input_ids) == host.batch_size * self.tokens_per_req
        )

    def bucket_for(self, bs: int) -> int:
        return next(b for b in self.buckets if b >= bs)

    def run(self, host: HostBatch, input_ids: torch.Tensor | None = None) -> LogitsOutput:
        """Forward `host` (can_run must hold) in its bucket's graph. input_ids: the token ids
        on the device instead of host.input_ids (e.g. fed back from the previous step)."""
        bs = host.batch_size
        bucket = self.bucket_for(bs)
        seq_lens = self._fill(host)
        if input_ids is not None:
            self.input_ids[: input_ids.numel()].copy_(input_ids)
        if bucket in self.graphs:
            self.runner.attn_backend.init_forward_metadata_replay(self._batches[bucket])
            self.graphs[bucket].replay()
        else:  # eager on the same buffers; the host lengths are this batch's (padded)
            self._forward(self._static_batch(bucket, seq_lens[:bucket].tolist()))
        return self._output_views(bs)

    def _fill(self, host: HostBatch) -> np.ndarray:
        """One copy of the batch, padded to the largest bucket, into the static inputs;
        returns the padded seq_lens."""
        n = len(host.input_ids)
        bs = host.batch_size

        def padded(values: np.ndarray, pad: np.ndarray) -> np.ndarray:
            return np.concatenate((values, pad[len(values) :]))

        assert n == bs * self.tokens_per_req
        ids, pad_rows = self._pad["ids"], self._pad["rows"]
        seq_lens = padded(host.seq_lens, self._pad["seq_lens"])
        self.staging.upload_into(
            self.packed,
            [
                padded(host.input_ids, ids),
                padded(host.positions, ids),
                padded(host.out_cache_loc, ids),
                padded(host.rows, pad_rows),
                seq_lens,
            ],
        )
        return seq_lens

    # ------------------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        self.graphs = capture_buckets(
            self.buckets,
            lambda bs: self._forward(self._batches[bs]),
            self.runner.device,
            f"{self.mode.name}, batch sizes",
        )

    def _static_batch(self, bs: int, seq_lens_cpu: list[int] | None = None) -> ForwardBatch:
        """The static buffers of bucket bs as a ForwardBatch. Host lengths: seq_lens_cpu, or
        the fill value when capturing (graph kernels read only the device ones)."""
        n = bs * self.tokens_per_req
        fill = self.runner.attn_backend.cuda_graph_seq_len_fill_value
        return make_batch(
            self.mode,
            self.input_ids[:n],
            self.positions[:n],
            self.out_cache_loc[:n],
            self.rows[:bs],
            seq_lens_cpu or [fill] * bs,
            [self.tokens_per_req] * bs,
            seq_lens=self.seq_lens[:bs],
            extend_seq_lens=self.extend_seq_lens[:bs],
        )

    def _forward(self, batch: ForwardBatch) -> None:
        """The captured work: metadata, the model, and copies into the static outputs."""
        out = graph_body(self.runner, batch, self.captures)
        if self.outputs is None:
            self.outputs = self._allocate_outputs(out, batch.batch_size)
        copy_kept(out, self.outputs, self.outputs_kept)

    def _allocate_outputs(self, out: LogitsOutput, bs: int) -> LogitsOutput:
        """Static outputs for max_bs, shaped like out (computed for bs requests)."""
        scale = self.max_bs // bs if self.max_bs % bs == 0 else None

        def like(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or not any(t is getattr(out, n) for n in self.outputs_kept):
                return None
            rows = t.shape[0] * scale if scale else self.max_bs * -(-t.shape[0] // bs)
            return torch.empty((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)

        return dataclasses.replace(
            out,
            next_token_logits=like(out.next_token_logits),
            hidden_states=like(out.hidden_states),
            aux_hidden_states=like(out.aux_hidden_states),
        )

    def _output_views(self, bs: int) -> LogitsOutput:
        assert self.outputs is not None
        n = bs * self.tokens_per_req
        rows = n if self.mode.samples_every_token() else bs

        def head(t: torch.Tensor | None, count: int) -> torch.Tensor | None:
            return None if t is None else t[:count]

        out = self.outputs
        return dataclasses.replace(
            out,
            next_token_logits=out.next_token_logits[:rows],
            hidden_states=head(out.hidden_states, n),
            aux_hidden_states=head(out.aux_hidden_states, n),
        )
