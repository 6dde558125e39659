"""`DecodeStep`: one plain (non-speculative) decode step of the target as one stage.

The stage reads each row's newest token and committed length from `RowState`, runs the target
forward on them, takes the argmax of the logits and commits it: the row's length grows by one
and the argmax becomes its newest token. On CUDA the whole of it is one graph replay per step
(`StageGraph`, buckets up to `--cuda-graph-max-bs`), so a decode step costs the host one input
copy, one replay and one result copy, whatever the model's depth.

A batch that is all plain greedy (no penalties, no sampling) uses the committed argmax as it is.
Any other batch samples eagerly from the stage's logits (`SamplingState.sample`) and overwrites
the rows' newest tokens with the sampled ones (`resample`); the lengths are already right.

Padded rows point at the reserved row 0 (token 0 at position 0, slot 0); the stage writes the
commit of those rows into row 0 and then puts row 0 back to token 0 and length 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_worker.forward_batch import ForwardMode, make_batch
from gpu_worker.model_runner import ModelRunner
from gpu_worker.row_state import RowState
from gpu_worker.stage_graph import PER_REQUEST, DirectStage, StageGraph


@dataclass(frozen=True)
class DecodeOutput:
    """Views valid until the next step: tokens [bs] (the committed argmax), logits [bs, V]
    float32, positions [bs] (each row's input position; the new token sits at + 1)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    positions: torch.Tensor


class DecodeStep:
    def __init__(self, runner: ModelRunner, state: RowState, graph_max_bs: int) -> None:
        """graph_max_bs: the largest batch replayed as a graph (captured on CUDA when the
        attention backend can be); 0 runs every step directly."""
        self.runner, self.state = runner, state
        if graph_max_bs <= 0:
            self.stage: StageGraph | DirectStage = DirectStage(self._step)
        else:
            device = runner.device
            capture = device.type == "cuda" and runner.attn_backend.supports_cuda_graph
            self.stage = StageGraph("decode step", self._step, {"rows": PER_REQUEST},
                                    graph_max_bs, device, capture)  # fmt: skip

    def __call__(self, rows: torch.Tensor) -> DecodeOutput:
        """One step for request rows [bs] (on the device)."""
        out = self.stage({"rows": rows}, [0] * rows.numel())
        return DecodeOutput(out["tokens"], out["logits"], out["positions"])

    def resample(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Replace the committed argmax of rows [bs] by tokens [bs] (sampled)."""
        self.state.tokens[rows] = tokens

    def _step(self, bs: int, inputs: dict[str, torch.Tensor], _: list[int]) -> dict:
        rows = inputs["rows"]
        state, backend = self.state, self.runner.attn_backend
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
        tokens = logits.argmax(dim=-1)
        state.commit_decode(rows, 1, tokens)
        state.reset_dummy()
        return {"tokens": tokens, "logits": logits, "positions": positions}
