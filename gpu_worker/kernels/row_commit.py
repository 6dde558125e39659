"""The end of an EAGLE iteration in one launch: each request row's committed length advances
by its accept length, its newest token becomes the last it emitted, and its draft state (the
first-level top-k and the hidden state the draft passes back) is read at its last accepted
position; what `store_rows` and `RowState.commit_accepted` do in a dozen small kernels.

A padded row of a graph (request row 0, the reserved dummy) writes nothing: row 0 stays at
token 0 and length 0 without a reset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2
from gpu_worker.step.row_state import RowState

BLOCK_H = 1024  # hidden elements copied per loop iteration


@dataclass(frozen=True)
class DraftState:
    """Per request row, what the next iteration's draft starts from: topk_p [rows, topk]
    float32, topk_index [rows, topk] int64 (target vocabulary), hidden [rows, H]."""

    topk_p: torch.Tensor
    topk_index: torch.Tensor
    hidden: torch.Tensor


def store_rows(draft: DraftState, rows: torch.Tensor, new: DraftState, last: torch.Tensor) -> None:
    """draft at rows [bs] <- new: its top-k per request ([bs, topk]) and its hidden states read
    at rows last [bs]."""
    draft.topk_p[rows], draft.topk_index[rows] = new.topk_p, new.topk_index
    draft.hidden[rows] = new.hidden[last]


def commit_rows_reference(
    state: RowState,
    draft: DraftState,
    rows: torch.Tensor,
    accept_lens: torch.Tensor,
    tokens: torch.Tensor,
    new: DraftState,
    last: torch.Tensor,
) -> None:
    """state: the rows' committed lengths and newest tokens; draft: their draft state, both
    written at rows [bs]; accept_lens [bs], tokens [bs, S+1]: the iteration's; new, last: as
    `store_rows` takes them."""
    store_rows(draft, rows, new, last)
    state.commit_accepted(rows, accept_lens, tokens)


@triton.jit
def _commit_rows_kernel(
    committed_lens_ptr,
    newest_ptr,
    rows_ptr,
    accept_lens_ptr,
    tokens_ptr,
    tokens_stride,
    topk_p_ptr,
    topk_index_ptr,
    hidden_ptr,
    new_topk_p_ptr,
    new_topk_p_stride,
    new_topk_index_ptr,
    new_topk_index_stride,
    new_hidden_ptr,
    new_hidden_stride,
    last_ptr,
    hidden_width,
    TOPK: tl.constexpr,
    TOPK_P2: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + b)
    if row != 0:  # a padded row of the batch writes nothing
        accepted = tl.load(accept_lens_ptr + b)
        token = tl.load(tokens_ptr + b * tokens_stride + accepted - 1)
        tl.store(committed_lens_ptr + row, tl.load(committed_lens_ptr + row) + accepted)
        tl.store(newest_ptr + row, token)
        k = tl.arange(0, TOPK_P2)
        kmask = k < TOPK
        p = tl.load(new_topk_p_ptr + b * new_topk_p_stride + k, mask=kmask)
        tl.store(topk_p_ptr + row * TOPK + k, p, mask=kmask)
        index = tl.load(new_topk_index_ptr + b * new_topk_index_stride + k, mask=kmask)
        tl.store(topk_index_ptr + row * TOPK + k, index, mask=kmask)
        source = new_hidden_ptr + tl.load(last_ptr + b) * new_hidden_stride
        h = tl.arange(0, BLOCK_H)
        for start in range(0, hidden_width, BLOCK_H):
            mask = start + h < hidden_width
            value = tl.load(source + start + h, mask=mask)
            tl.store(hidden_ptr + row * hidden_width + start + h, value, mask=mask)


def commit_rows(
    state: RowState,
    draft: DraftState,
    rows: torch.Tensor,
    accept_lens: torch.Tensor,
    tokens: torch.Tensor,
    new: DraftState,
    last: torch.Tensor,
) -> None:
    """`commit_rows_reference` in one launch (rows unique but for row 0, the padded ones)."""
    bs, topk = rows.shape[0], draft.topk_p.shape[1]
    for name in ("topk_p", "topk_index", "hidden"):
        assert getattr(draft, name).is_contiguous(), name
    assert new.topk_p.stride(1) == 1 or topk == 1, "a row's top-k entries side by side"
    assert new.topk_index.stride(1) == 1 or topk == 1
    assert new.hidden.stride(1) == 1 and tokens.stride(1) == 1
    _commit_rows_kernel[(bs,)](
        state.committed_lens,
        state.tokens,
        rows,
        accept_lens,
        tokens,
        tokens.stride(0),
        draft.topk_p,
        draft.topk_index,
        draft.hidden,
        new.topk_p,
        new.topk_p.stride(0),
        new.topk_index,
        new.topk_index.stride(0),
        new.hidden,
        new.hidden.stride(0),
        last,
        draft.hidden.shape[1],
        TOPK=topk,
        TOPK_P2=next_power_of_2(topk),
        BLOCK_H=BLOCK_H,
    )
