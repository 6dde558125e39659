from __future__ import annotations

import torch

from gpu_worker.speculative.draft_layout import (
    draft_alloc_len,
    draft_cache_locs,
    draft_decode_mask,
    draft_run_positions,
    draft_seq_lens,
    draft_step_positions,
)

SEQ = [4, 7, 5]
TOPK, STEPS = 2, 3


def make_req_to_token(num_rows: int = 6, width: int = 32, seed: int = 0) -> torch.Tensor:
    """int32 table with distinct, shuffled slot ids (row 0 = dummy zeros)."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_rows * width, generator=gen).view(num_rows, width) + 1
    table[0] = 0
    return table.to(torch.int32)


def test_draft_alloc_len():
    assert draft_alloc_len(4, 3, 8) == 12
    assert draft_alloc_len(1, 3, 4) == 4
    assert draft_alloc_len(8, 5, 64) == 64


def test_draft_cache_layout_single_owner():
    committed_lens = torch.tensor(SEQ)
    pool_idx = torch.tensor([3, 1, 5])
    table = make_req_to_token()
    positions = draft_step_positions(committed_lens, TOPK, STEPS)
    locs = draft_cache_locs(table, pool_idx, committed_lens, TOPK, STEPS)
    assert positions.shape == locs.shape == (STEPS, len(SEQ) * TOPK)
    assert positions.dtype == locs.dtype == torch.int64
    for b, seq in enumerate(SEQ):
        for j in range(TOPK):
            for i in range(STEPS):
                row = b * TOPK + j
                assert positions[i, row] == seq + j * STEPS + i
                assert locs[i, row] == table[pool_idx[b], seq + j * STEPS + i]
    # Every branch slot is distinct and lies inside the per-request headroom.
    assert len(set(locs.flatten().tolist())) == locs.numel()
    assert bool(
        (positions < committed_lens.repeat_interleave(TOPK) + draft_alloc_len(TOPK, STEPS, 4)).all()
    )

    seq_lens = draft_seq_lens(committed_lens, TOPK, STEPS)
    assert seq_lens.tolist() == [s + TOPK * STEPS for s in SEQ]
    for step in range(STEPS):
        mask = draft_decode_mask(len(SEQ), TOPK, STEPS, step, "cpu")  # [bs, topk, topk*S]
        assert mask.dtype == torch.bool and mask.shape == (len(SEQ), TOPK, TOPK * STEPS)
        for b, seq in enumerate(SEQ):
            for j in range(TOPK):
                # columns are the draft keys seq .. seq + topk*S - 1; the prefix is always seen
                seen = {seq + int(c) for c in torch.nonzero(mask[b, j]).flatten()}
                own = {int(positions[i, b * TOPK + j]) for i in range(step + 1)}
                assert seen == own == {seq + j * STEPS + i for i in range(step + 1)}


def test_draft_positions():
    committed_lens = torch.tensor(SEQ)
    steps = 4
    first = draft_run_positions(committed_lens, TOPK, 0)
    assert first.tolist() == [s for s in SEQ for _ in range(TOPK)]  # step 0 runs at seq, not seq+1
    last = draft_run_positions(committed_lens, TOPK, steps - 2)  # the last step that is forwarded
    assert last.tolist() == [s + steps - 2 for s in SEQ for _ in range(TOPK)]
    # Branch 0 writes its KV at the position it runs at; other branches at their own block.
    written = draft_step_positions(committed_lens, TOPK, steps)
    for i in range(steps - 1):
        run = draft_run_positions(committed_lens, TOPK, i)
        assert torch.equal(written[i, 0::TOPK], run[0::TOPK])
        assert torch.equal(written[i, 1::TOPK], run[1::TOPK] + steps)
