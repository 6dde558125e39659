"""`DecodeStep`: one plain (non-speculative) decode step of the target as one stage.

The stage reads each row's newest token and committed length from `RowState`, runs the target
forward on them, picks each row's next token and commits it: the row's length grows by one
and the token becomes its newest. On CUDA the whole of it is one graph replay per step
(`StageGraph`, buckets up to `--cuda-graph-max-bs`), so a decode step costs the host one input
copy, one replay and one result copy, whatever the model's depth, and whatever its sampling.

How the token is picked is a variant of the stage, each with its own graphs (one memory pool):
- "greedy": the argmax of the logits, for batches of plain greedy rows that want no logprobs;
- "sample": `SamplingState.sample` with every stage on but the sort (penalties, temperature,
  min-p), and the logprobs; greedy rows of the batch take the argmax of penalised logits;
- "filter": the same with top-k / top-p, for batches where a row asks for them.
Stages a row does not use leave its logits unchanged, so a variant gives each row the token
(and logprob) the eager sampler gives it; `variant_for` picks the cheapest that serves a batch.

Padded rows point at the reserved row 0 (token 0 at position 0, slot 0); the stage writes the
commit of those rows into row 0 and then puts row 0 back to token 0 and length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gpu_worker.forward_batch import ForwardMode, make_batch
from gpu_worker.model_runner import ModelRunner
from gpu_worker.row_state import RowState
from gpu_worker.sampling import SamplingState, fixed_flags
from gpu_worker.stage_graph import PER_REQUEST, DirectStage, StageGraph

VARIANTS = ("greedy", "sample", "filter")


@dataclass(frozen=True)
class DecodeOutput:
    """Views valid until the next step: tokens [bs] (committed), logprobs [bs] float32 (None
    from the greedy variant)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor | None


class DecodeStep:
    def __init__(self, runner: ModelRunner, state: RowState, sampling: SamplingState,
                 graph_max_bs: int) -> None:  # fmt: skip
        """graph_max_bs: the largest batch replayed as a graph (captured on CUDA when the
        attention backend can be); 0 runs every step directly."""
        self.runner, self.state, self.sampling = runner, state, sampling
        self.stages: dict[str, StageGraph | DirectStage] = {}
        device = runner.device
        capture = device.type == "cuda" and runner.attn_backend.supports_cuda_graph
        pool = torch.cuda.graph_pool_handle() if capture and graph_max_bs > 0 else None
        for variant in VARIANTS:
            def step(bs, inputs, prefix_cpu, variant=variant):  # noqa: ANN001
                return self._step(variant, inputs["rows"])

            if graph_max_bs <= 0:
                self.stages[variant] = DirectStage(step)
            else:
                self.stages[variant] = StageGraph(f"decode step, {variant}", step,
                                                  {"rows": PER_REQUEST}, graph_max_bs, device,
                                                  capture, pool)  # fmt: skip

    def variant_for(self, rows_cpu: np.ndarray, want_logprobs: bool) -> str:
        """The cheapest variant that gives every row of the batch its own token."""
        beyond_argmax, sort = self.sampling.needs(rows_cpu)
        if not (want_logprobs or beyond_argmax):
            return "greedy"
        return "filter" if sort else "sample"

    def __call__(self, rows: torch.Tensor, variant: str = "greedy") -> DecodeOutput:
        """One step for request rows [bs] (on the device)."""
        out = self.stages[variant]({"rows": rows}, [0] * rows.numel())
        return DecodeOutput(out["tokens"], out.get("logprobs"))

    def _step(self, variant: str, rows: torch.Tensor) -> dict:
        state, backend = self.state, self.runner.attn_backend
        bs = rows.numel()
        input_ids, positions, out_cache_loc, seq_lens = state.decode_inputs(
            rows, self.runner.req_to_token_pool.req_to_token
        )
        if backend.reads_host_lengths:  # the reference backend, never captured
            lens_cpu = seq_lens.tolist()
        else:
            lens_cpu = [backend.cuda_graph_seq_len_fill_value] * bs
        # Every length on the device already: a copy from the host cannot be captured.
        batch = make_batch(ForwardMode.DECODE, input_ids, positions, out_cache_loc, rows,
                           lens_cpu, [1] * bs, seq_lens=seq_lens,
                           extend_seq_lens=torch.ones_like(seq_lens))  # fmt: skip
        logits = self.runner.forward(batch).next_token_logits.float()
        if variant == "greedy":
            tokens, result = logits.argmax(dim=-1), {}
        else:
            flags = fixed_flags(sort=variant == "filter")
            tokens, logprobs = self.sampling.sample(logits, rows, positions + 1, flags=flags)
            result = {"logprobs": logprobs}
        state.commit_decode(rows, 1, tokens)
        state.reset_dummy()
        return {"tokens": tokens, **result}
