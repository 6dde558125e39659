"""The multi-step draft cache layout: the single owner of where draft KV lives.

Draft step i of branch j writes the draft pool at position prefix + j*S + i of the request's
`req_to_token` row (rows request-major: `row = b*topk + j`); the verify tree reuses prefix ..
prefix+ND-1 in the target pool. Nothing else computes draft positions or slots.
"""

from __future__ import annotations

import torch

from aerie.config import draft_alloc_len
from gpu_worker import constants

__all__ = ["draft_alloc_len"]  # owned by aerie.config so the torch-free scheduler shares it


def draft_seq_lens(committed_lens: torch.Tensor, topk: int, num_steps: int) -> torch.Tensor:
    """Keys attended in draft decode per request: `prefix + topk*S` (prefix + every branch slot).

    committed_lens [bs] (any int dtype, any device) -> [bs] int64 on the same device.
    """
    return committed_lens.to(torch.int64) + topk * num_steps


def draft_run_positions(committed_lens: torch.Tensor, topk: int, step: int) -> torch.Tensor:
    """Position every row is RUN at in draft decode step `step`: `prefix + step` -> [bs*topk] int64.

    Step 0 runs at `prefix` (the bonus position; draft position = target position of the input
    token - 1), not prefix+1; positions advance only after each forward.
    """
    positions = committed_lens.to(torch.int64)
    positions = positions if topk == 1 else positions.repeat_interleave(topk)
    return positions + step if step else positions


def draft_step_positions(committed_lens: torch.Tensor, topk: int, num_steps: int) -> torch.Tensor:
    """Logical positions where each draft step writes its KV: [S, bs*topk] int64.

    Entry `[i, b*topk + j]` = `prefix_b + j*S + i`. committed_lens [bs] on any device; output on
    it too.
    """
    device = committed_lens.device
    bs = committed_lens.shape[0]
    branch_base = constants.arange(topk, device) * num_steps  # [topk]
    row_base = committed_lens.to(torch.int64)[:, None] + branch_base[None, :]  # [bs, topk]
    steps = constants.arange(num_steps, device)  # [S]
    return row_base.view(1, bs * topk) + steps[:, None]  # [S, bs*topk]


def draft_cache_locs(
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    committed_lens: torch.Tensor,
    topk: int,
    num_steps: int,
) -> torch.Tensor:
    """KV slot ids the draft steps write: [S, bs*topk] int64 = req_to_token[row, position].

    req_to_token [rows, max_context_len] (int32 or int64), rows [bs], committed_lens
    [bs], all on one device. Positions come from `draft_step_positions`. Reads only.
    """
    positions = draft_step_positions(committed_lens, topk, num_steps)  # [S, bs*topk]
    rows = rows.to(torch.int64)
    rows = rows if topk == 1 else rows.repeat_interleave(topk)  # [bs*topk]
    return req_to_token[rows[None, :], positions].to(torch.int64)


def draft_decode_mask(bs: int, topk: int, num_steps: int, step: int, device) -> torch.Tensor:
    """Tree-local custom mask of draft decode step `step`: [bs, topk, topk*S] bool over the
    draft keys [prefix, prefix + topk*S) of each request (the prefix before them is visible).

    Row `j` sees the positions of its own branch written so far, `prefix + j*S + i'` for
    `i' <= step` (row-local, as SGLang: a re-parented row still sees its own earlier draft KV).
    The same for every request, so it needs neither committed_lens nor a host read.
    """
    return _branch_mask(topk, num_steps, step, torch.device(device)).expand(
        bs, topk, topk * num_steps
    )


def _branch_mask(topk: int, num_steps: int, step: int, device: torch.device) -> torch.Tensor:
    """[topk, topk*S] of `draft_decode_mask`, a constant made once per shape."""

    def make() -> torch.Tensor:
        keys = torch.arange(topk * num_steps, device=device)  # offset j*S + i from prefix
        rows = torch.arange(topk, device=device)
        return (keys[None, :] // num_steps == rows[:, None]) & (keys[None, :] % num_steps <= step)

    return constants.cached(("draft_decode_mask", topk, num_steps, step), device, make)
