"""`DecodeStep`: one plain (non-speculative) decode step of the target as one stage.

The stage writes the step's new KV slots into every runner's table, reads each row's token
and length from `RowState`, runs the target, picks the next token (a variant per kind of
batch, `variant_for`) and commits it. Padded rows run on row 0, which the stage then resets to
token 0, length 0 (`docs/gpu.md`, "The plain decode step").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic

import numpy as np
import torch

from gpu_worker.graphs.stage_graph import (
    PER_REQUEST,
    Array,
    DirectStage,
    StageGraph,
    StageInput,
)
from gpu_worker.kv_cache.req_to_token import ReqToTokenPool
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import SamplingState, fixed_flags
from gpu_worker.step.forward_batch import decode_batch
from gpu_worker.step.row_state import RowState

VARIANTS = ("greedy", "sample", "filter")


@dataclass
class DecodeStepInputs(Generic[Array]):
    """A step's inputs, host arrays for `StageGraph.call_host` and flat tensors in the stage:
    rows [bs] int64; slot_index [n] int64 and slot_value [n] int32, the new KV slots to record
    (`ReqToTokenPool.flat_index`)."""

    rows: Array
    slot_index: Array
    slot_value: Array


@dataclass(frozen=True)
class DecodeOutput:
    """Views valid until the next step: tokens [bs] (committed), logprobs [bs] float32 (None
    from the greedy variant)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None


class DecodeStep:
    def __init__(
        self,
        runner: ModelRunner,
        state: RowState,
        sampling: SamplingState,
        graph_max_bs: int,
        pools: list[ReqToTokenPool] | None = None,
        slots_per_row: int = 1,
        graph_pool=None,
    ) -> None:
        """graph_max_bs: the largest batch replayed as a graph (captured on CUDA when the
        attention backend can be); 0 runs every step directly. pools: the req_to_token tables
        a step records its new slots in (default: the runner's), all of one width.
        slots_per_row: new slots per row of a bucket the stage takes (a decode step's
        headroom, `--speculative` aside: one). graph_pool: a CUDA graph memory pool to
        capture into (default: a new one), e.g. the speculative stages', whose graphs never
        run at the same time as these."""
        self.runner, self.state, self.sampling = runner, state, sampling
        self.pools = pools or [runner.req_to_token_pool]
        self.slots_per_row = slots_per_row
        self.stages: dict[str, StageGraph | DirectStage] = {}
        device = runner.device
        capture = device.type == "cuda" and runner.attn_backend.supports_cuda_graph
        pool = None
        if capture and graph_max_bs > 0:
            pool = graph_pool if graph_pool is not None else torch.cuda.graph_pool_handle()
        inputs = {
            "rows": PER_REQUEST,
            "slot_index": StageInput((slots_per_row,)),
            "slot_value": StageInput((slots_per_row,), torch.int32),
        }
        for variant in VARIANTS:

            def step(bs, inputs, committed_lens_cpu, variant=variant):  # noqa: ANN001
                return self._step(variant, inputs)

            if graph_max_bs <= 0:
                self.stages[variant] = DirectStage(step, device, inputs)
            else:
                self.stages[variant] = StageGraph(
                    f"decode step, {variant}",
                    step,
                    DecodeStepInputs,
                    inputs,
                    graph_max_bs,
                    device,
                    capture,
                    pool,
                    host_inputs=True,
                )

    def slot_capacity(self, bs: int) -> int | None:
        """The most new slots a step of bs rows can record itself (None: no bound); a step with
        more has them written first (`ReqToTokenPool.assign`) and passes none."""
        bucket = self.stages[VARIANTS[0]].capacity(bs)
        return None if bucket is None else bucket * self.slots_per_row

    def variant_for(self, rows_cpu: np.ndarray, want_logprobs: bool) -> str:
        """The cheapest variant that gives every row of the batch its own token."""
        beyond_argmax, sort = self.sampling.needs(rows_cpu)
        if not (want_logprobs or beyond_argmax):
            return "greedy"
        return "filter" if sort else "sample"

    def __call__(
        self,
        rows: np.ndarray,
        slot_index: np.ndarray,
        slot_value: np.ndarray,
        variant: str = "greedy",
    ) -> DecodeOutput:
        """One step for request rows [bs] (host int64) that first records slot_value[i] (int32)
        at flat index slot_index[i] (`ReqToTokenPool.flat_index`) of every pool, at most
        `slot_capacity(bs)` of them."""
        inputs = DecodeStepInputs(rows, slot_index, slot_value)
        return self.stages[variant].call_host(len(rows), inputs)

    def _step(self, variant: str, inputs: DecodeStepInputs[torch.Tensor]) -> DecodeOutput:
        state, backend = self.state, self.runner.attn_backend
        rows, slot_index = inputs.rows, inputs.slot_index
        if slot_index.numel():  # (none on a direct step that brings no new slots)
            for pool in self.pools:
                pool.assign(slot_index, inputs.slot_value)
        input_ids, positions, out_cache_loc, seq_lens = state.decode_inputs(
            rows, self.runner.req_to_token_pool.req_to_token
        )
        batch = decode_batch(backend, input_ids, positions, out_cache_loc, rows, seq_lens)
        logits = self.runner.forward(batch).next_token_logits.float()
        if variant == "greedy":
            tokens, logprobs = logits.argmax(dim=-1), None
        else:
            flags = fixed_flags(sort=variant == "filter")
            tokens, logprobs = self.sampling.sample(logits, rows, positions + 1, flags=flags)
            # Penalties count the token (rows without penalties count harmlessly: a request
            # that uses them resets its row's counts when it starts).
            self.sampling.observe(rows, tokens, always=True)
        state.commit_decode(rows, 1, tokens)
        state.reset_dummy()
        return DecodeOutput(tokens, logprobs)
