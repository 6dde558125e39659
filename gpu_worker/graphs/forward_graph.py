"""A runner's forward as a `StageGraph`: plain decode batches, and short prefills by tokens.

Both take their inputs from the host in one packed copy and pad their bucket with the reserved
dummies (token 0 at position 0 in slot 0, row 0 with no keys), which nothing attends or reads.
`decode_graphs` serves a standalone runner (the server's step is `DecodeStep`); `PrefillGraphs`
buckets EXTEND batches by tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic

import torch

from gpu_worker.graphs.stage_graph import PER_REQUEST, Array, StageGraph, StageInput
from gpu_worker.step.forward_batch import (
    ForwardBatch,
    ForwardMode,
    LogitsOutput,
    decode_batch,
    make_batch,
)
from gpu_worker.step.host_batch import HostBatch

if TYPE_CHECKING:
    from gpu_worker.model_runner import ModelRunner
    from gpu_worker.models import ArchConfig

MIN_TOKENS = 16  # the smallest prefill bucket
MAX_REQUESTS = 64  # requests one prefill bucket holds at most


@dataclass
class DecodeInputs(Generic[Array]):
    """A DECODE batch's inputs, one per request (host arrays for `call_host`; seq_lens: the
    KV length after the forward)."""

    input_ids: Array
    positions: Array
    out_cache_loc: Array
    rows: Array
    seq_lens: Array


def decode_graphs(runner: ModelRunner, max_bs: int, capture: bool) -> StageGraph:
    """runner's DECODE forward for up to max_bs requests: `DecodeInputs` -> a `LogitsOutput`
    of the logits only."""
    fill = runner.attn_backend.cuda_graph_seq_len_fill_value
    specs = {
        "input_ids": PER_REQUEST,
        "positions": PER_REQUEST,
        "out_cache_loc": PER_REQUEST,
        "rows": PER_REQUEST,
        "seq_lens": StageInput(pad=fill),
    }

    def forward(bs: int, inputs: DecodeInputs[torch.Tensor], _: list[int]) -> LogitsOutput:
        batch = decode_batch(
            runner.attn_backend,
            inputs.input_ids,
            inputs.positions,
            inputs.out_cache_loc,
            inputs.rows,
            inputs.seq_lens,
        )
        return LogitsOutput(runner.forward(batch).next_token_logits, None)

    return StageGraph(
        "decode forward",
        forward,
        DecodeInputs,
        specs,
        max_bs,
        runner.device,
        capture,
        host_inputs=True,
    )


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
    """Requests a prefill bucket of `tokens` tokens holds."""
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


@dataclass
class PrefillInputs(Generic[Array]):
    """An EXTEND batch's inputs (host arrays for `call_host`): input_ids, positions and
    out_cache_loc per token, rows, seq_lens (KV length after the forward) and extend_seq_lens
    per request, each a flat list as long as the bucket (the per-request ones use its head)."""

    input_ids: Array
    positions: Array
    out_cache_loc: Array
    rows: Array
    seq_lens: Array
    extend_seq_lens: Array


class PrefillGraphs:
    """EXTEND batches of up to max_tokens tokens, bucketed by tokens: a bucket of T tokens
    holds up to min(T, MAX_REQUESTS) requests, and under capture its attention grid is sized
    for one extend of T tokens, which covers any request it holds."""

    def __init__(
        self, runner: ModelRunner, max_tokens: int, capture: bool, keep_hidden: bool = False
    ) -> None:
        """capture: record graphs (CUDA, a backend that can be captured); else run the same
        padded path eagerly. keep_hidden: keep every token's hidden (and aux) states too."""
        buckets = token_buckets(max_tokens)
        if not buckets:
            raise ValueError("prefill graphs need max_tokens >= 1")
        self.runner, self.keep_hidden = runner, keep_hidden
        self.max_requests = requests_for(buckets[-1])
        specs = {f.name: PER_REQUEST for f in dataclasses.fields(PrefillInputs)}
        self.stage = StageGraph(
            "prefill, tokens",
            self._forward,
            PrefillInputs,
            specs,
            buckets[-1],
            runner.device,
            capture,
            host_inputs=True,
            buckets=buckets,
            output_rows={"next_token_logits": requests_for},
        )

    @property
    def max_tokens(self) -> int:
        return self.stage.max_bs

    def bucket_for(self, num_tokens: int, batch_size: int) -> int | None:
        """The smallest bucket that holds the batch, or None."""
        return next(
            (t for t in self.stage.buckets if t >= num_tokens and requests_for(t) >= batch_size),
            None,
        )

    def can_run(self, host: HostBatch) -> bool:
        return (
            host.mode == ForwardMode.EXTEND
            and host.batch_size > 0
            and self.bucket_for(len(host.input_ids), host.batch_size) is not None
        )

    def run(self, host: HostBatch) -> tuple[ForwardBatch, LogitsOutput]:
        """Forward `host` (can_run must hold) in its bucket: the real batch (views of the
        static inputs, with the plan's host lengths) and the outputs (views valid until the
        next run; the hidden states only with keep_hidden)."""
        n, bs = len(host.input_ids), host.batch_size
        arrays = PrefillInputs(
            host.input_ids,
            host.positions,
            host.out_cache_loc,
            host.rows,
            host.seq_lens,
            host.extend_seq_lens,
        )
        out = self.stage.call_host(n, arrays)
        inputs = self.stage.inputs
        real = make_batch(
            ForwardMode.EXTEND,
            inputs.input_ids[:n],
            inputs.positions[:n],
            inputs.out_cache_loc[:n],
            inputs.rows[:bs],
            host.seq_lens.tolist(),
            host.extend_seq_lens.tolist(),
            seq_lens=inputs.seq_lens[:bs],
            extend_seq_lens=inputs.extend_seq_lens[:bs],
        )
        logits = out.next_token_logits[:bs]
        return real, LogitsOutput(logits, out.hidden_states, out.aux_hidden_states)

    def _forward(
        self, tokens: int, inputs: PrefillInputs[torch.Tensor], _: list[int]
    ) -> LogitsOutput:
        r = requests_for(tokens)
        seq_lens, extend_lens = inputs.seq_lens[:r], inputs.extend_seq_lens[:r]
        if self.runner.attn_backend.reads_host_lengths:  # the reference backend: real ones
            lens, extend = seq_lens.tolist(), extend_lens.tolist()
        else:  # the host lengths only size the grid: the longest extend a bucket holds
            lens = extend = [tokens] * r
        batch = make_batch(
            ForwardMode.EXTEND,
            inputs.input_ids,
            inputs.positions,
            inputs.out_cache_loc,
            inputs.rows[:r],
            lens,
            extend,
            seq_lens=seq_lens,
            extend_seq_lens=extend_lens,
        )
        out = self.runner.forward(batch)
        if not self.keep_hidden:
            return LogitsOutput(out.next_token_logits, None)
        return LogitsOutput(out.next_token_logits, out.hidden_states, out.aux_hidden_states)
