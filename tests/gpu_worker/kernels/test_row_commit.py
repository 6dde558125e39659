"""The end of an EAGLE iteration in one launch against its torch reference: random rows
(padded ones on row 0), accept lengths, top-k and hidden states; row 0 stays the dummy."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.row_commit import DraftState, commit_rows, commit_rows_reference
from gpu_worker.step.row_state import RowState
from tests.devices import triton_devices


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("topk, hidden_width", [(1, 64), (4, 1500)])
def test_commit_rows_matches_the_reference(device, topk, hidden_width):
    gen = torch.Generator().manual_seed(topk)
    num_rows, width, live = 12, 4, 5
    rows = torch.cat(
        [torch.randperm(num_rows - 1, generator=gen)[:live] + 1, torch.zeros(3, dtype=torch.int64)]
    )
    bs = rows.shape[0]
    accept_lens = torch.randint(1, width + 1, (bs,), generator=gen)
    tokens = torch.randint(0, 1000, (bs, width), generator=gen)
    new = DraftState(
        torch.rand(bs, topk, generator=gen),
        torch.randint(0, 1000, (bs, topk), generator=gen),
        torch.randn(bs * width, hidden_width, generator=gen),
    )
    last = torch.arange(bs) * width + accept_lens - 1
    starts = {
        "committed_lens": torch.randint(1, 50, (num_rows,), generator=gen),
        "newest": torch.randint(0, 1000, (num_rows,), generator=gen),
        "topk_p": torch.rand(num_rows, topk, generator=gen),
        "topk_index": torch.randint(0, 1000, (num_rows, topk), generator=gen),
        "hidden": torch.randn(num_rows, hidden_width, generator=gen),
    }
    for name in ("committed_lens", "newest"):
        starts[name][0] = 0  # the dummy row as the worker keeps it
    results = []
    for commit in (commit_rows_reference, commit_rows):
        s = {name: value.clone().to(device) for name, value in starts.items()}
        state = RowState(num_rows, torch.device(device))
        state.committed_lens, state.tokens = s["committed_lens"], s["newest"]
        draft = DraftState(s["topk_p"], s["topk_index"], s["hidden"])
        args = [t.to(device) for t in (rows, accept_lens, tokens)]
        commit(
            state,
            draft,
            *args,
            DraftState(*(t.to(device) for t in (new.topk_p, new.topk_index, new.hidden))),
            last.to(device),
        )
        results.append({name: value.cpu() for name, value in s.items()})
    want, got = results
    for name in ("committed_lens", "newest"):
        assert torch.equal(got[name], want[name]), name
    live_rows = rows[:live]
    for name in ("topk_p", "topk_index", "hidden"):  # the reference also wrote the dummy row
        assert torch.equal(got[name][1:], want[name][1:]), name
        assert not torch.equal(got[name][live_rows], starts[name][live_rows]), name
    assert torch.equal(
        got["committed_lens"][live_rows], starts["committed_lens"][live_rows] + accept_lens[:live]
    )
