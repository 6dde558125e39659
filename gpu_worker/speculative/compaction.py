"""Accepted-path compaction after verify (topk > 1; in a chain node j already sits at prefix + j).

Accepted node k at depth j moves to position prefix + j: `compaction_moves` lists the KV
copies, `compact_rows` reorders per-node rows the same way. Both are sized bs*(S+1), unused
entries zero (slot 0 -> slot 0). An in-order copy is safe too: node_j >= j, so a destination
is only ever the source of an earlier entry.
"""

from __future__ import annotations

import torch

from gpu_worker import constants
from gpu_worker.speculative.verify import VerifyResult


def compaction_moves(
    result: VerifyResult,
    committed_lens: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    num_draft_tokens: int,
    num_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KV moves that put the accepted path at the front of each verify block.

    committed_lens [bs] (pre-verify committed length), req_to_token [rows, max_context_len],
    rows [bs], all on one device -> (dst_slots, src_slots), each [bs*(S+1)] int64
    with request b's entries at `b*(S+1) + j`: for j < accept_lens[b], dst = slot at position
    `prefix + j`, src = slot at `prefix + (accept_index[b, j] - b*ND)`; 0 past the accept length.
    Identity moves (node_j == j) are included. Reads only.
    """
    bs = committed_lens.shape[0]
    device = committed_lens.device
    width = num_steps + 1
    step = constants.arange(width, device)  # [S+1]
    valid = step[None, :] < result.accept_lens[:, None]  # [bs, S+1]
    base = constants.arange(bs, device)[:, None] * num_draft_tokens
    node = torch.where(valid, result.accept_index - base, 0)  # [bs, S+1] local node ids
    prefix = committed_lens.to(torch.int64)[:, None]
    rows = rows.to(torch.int64)[:, None]
    max_pos = req_to_token.shape[1] - 1
    dst = req_to_token[rows, (prefix + step[None, :]).clamp(max=max_pos)].to(torch.int64)
    src = req_to_token[rows, (prefix + node).clamp(max=max_pos)].to(torch.int64)
    zero = torch.zeros_like(dst)
    return torch.where(valid, dst, zero).flatten(), torch.where(valid, src, zero).flatten()


def compact_rows(x: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """Rows of the accepted path in order: x [bs*ND, ...] -> [bs*(S+1), ...] (zero rows at -1).

    E.g. verify hidden states or predict; row `b*(S+1) + j` = x[accept_index[b, j]].
    """
    index = result.accept_index.flatten()  # [bs*(S+1)]
    rows = x[index.clamp(min=0)]
    keep = (index >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, rows, torch.zeros_like(rows))
