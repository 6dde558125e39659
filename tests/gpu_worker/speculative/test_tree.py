from __future__ import annotations

import pytest
import torch

from gpu_worker.speculative.compaction import compact_rows, compaction_moves
from gpu_worker.speculative.tree import (
    DraftRecord,
    build_tree,
    organize_draft,
    select_first_level,
    select_next_level,
)
from gpu_worker.speculative.verify import accepted_tokens, verify_greedy
from tests.gpu_worker.speculative.trees import TREE_FIELDS, parents_of, run_draft_loop


def rows_of(bits: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in bits])


def test_build_tree_golden():
    # The vector of SGLang's test_build_eagle_tree.py: bs=2, topk=4, S=4, ND=8.
    committed_lens = [5, 10]
    top_scores_index = torch.tensor([[0, 1, 4, 8, 20, 24, 36], [0, 4, 5, 6, 7, 24, 36]])
    parent_list = torch.tensor(
        [
            [-1, 0, 1, 2, 3, 4, 8, 9, 10, 20, 24, 21, 28],
            [-1, 0, 1, 2, 3, 4, 5, 6, 7, 24, 25, 26, 27],
        ]
    )
    draft = torch.tensor(
        [
            [29896, 29906, 29889, 29974, 29946, 29896, 29946],
            [13, 22550, 4136, 16492, 8439, 29871, 29941],
        ]
    )
    tree = build_tree(
        torch.tensor([29974, 13]),
        parent_list,
        top_scores_index,
        draft,
        torch.tensor(committed_lens),
        4,
        4,
        8,
    )
    assert tree.positions.tolist() == [5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14]
    assert tree.retrieve_index.tolist() == [list(range(8)), list(range(8, 16))]
    assert tree.next_token.tolist() == [[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]]
    assert tree.next_sibling.tolist() == [
        [-1, 2, -1, -1, -1, -1, -1, -1],
        [-1, -1, 3, 4, 5, -1, -1, -1],
    ]
    assert tree.tokens.tolist() == [
        29974,
        29896,
        29906,
        29889,
        29974,
        29946,
        29896,
        29946,
        13,
        13,
        22550,
        4136,
        16492,
        8439,
        29871,
        29941,
    ]
    qlen_rows = [
        [
            "10000000",
            "11000000",
            "10100000",
            "11010000",
            "10101000",
            "11010100",
            "10101010",
            "11010101",
        ],
        [
            "10000000",
            "11000000",
            "11100000",
            "11010000",
            "11001000",
            "11000100",
            "11010010",
            "11010011",
        ],
    ]
    assert tree.custom_mask.shape == (2, 8, 8)  # tree-local: over the 8 node keys only
    for b in range(2):
        assert torch.equal(tree.custom_mask[b], rows_of(qlen_rows[b]))


def test_tree_example_B():
    # A hand-worked tree: topk=2, S=2, ND=4; a=10 (.6), b=11 (.3); a->c=12 (.36), a->d=13 (.12),
    # b->e=14 (.24), b->f=15 (.03). The target prefers b after the root, then y=99.
    record = DraftRecord()
    hidden0 = torch.tensor([[1.0]])
    _, hidden, scores = select_first_level(
        torch.tensor([[0.6, 0.3]]), torch.tensor([[10, 11]]), hidden0, record
    )
    _, _, scores = select_next_level(
        scores,
        torch.tensor([[0.6, 0.2], [0.8, 0.1]]),
        torch.tensor([[12, 13], [14, 15]]),
        torch.tensor([[2.0], [3.0]]),
        1,
        record,
    )
    top, draft_tokens, parent_list = organize_draft(record, 4, 2, 2)
    assert top.tolist() == [[0, 1, 2]] and parent_list.tolist() == [[-1, 0, 1]]
    assert draft_tokens.tolist() == [[10, 11, 12]]
    seq = 7
    tree = build_tree(
        torch.tensor([5]), parent_list, top, draft_tokens, torch.tensor([seq]), 2, 2, 4
    )
    assert tree.next_token.tolist() == [[1, 3, -1, -1]]
    assert tree.next_sibling.tolist() == [[-1, 2, -1, -1]]
    assert tree.positions.tolist() == [seq, seq + 1, seq + 1, seq + 2]

    result = verify_greedy(tree, torch.tensor([11, 0, 99, 0]))
    assert result.accept_index.tolist() == [[0, 2, -1]]
    assert result.num_correct.tolist() == [1] and result.accept_lens.tolist() == [2]
    assert result.predict.tolist() == [11, 0, 99, 0]
    assert accepted_tokens(result).tolist() == [[11, 99, 0]]  # b, then the bonus y

    req_to_token = torch.arange(100, 140, dtype=torch.int32).view(2, 20)
    dst, src = compaction_moves(result, torch.tensor([seq]), req_to_token, torch.tensor([1]), 4, 2)
    slot = req_to_token[1]
    assert dst.tolist() == [slot[seq], slot[seq + 1], 0]
    assert src.tolist() == [slot[seq], slot[seq + 2], 0]
    assert compact_rows(result.predict, result).tolist() == [11, 99, 0]
    hidden = torch.tensor([[0.0], [1.0], [2.0], [3.0]])  # verify hidden per node
    # The draft extend reads accepted row 1: node 2's hidden (b at position seq+1).
    assert compact_rows(hidden, result)[1].tolist() == [2.0]


def test_select_top_k_hidden_offsets():
    bs, topk, hidden_size = 3, 2, 4
    gen = torch.Generator().manual_seed(3)
    record = DraftRecord()
    hidden = torch.randn(bs, hidden_size, generator=gen)
    topk_p = torch.softmax(torch.randn(bs, topk, generator=gen), -1)
    ids, hidden_rows, scores = select_first_level(
        topk_p, torch.arange(bs * topk).view(bs, topk), hidden, record
    )
    assert torch.equal(hidden_rows, hidden.repeat_interleave(topk, 0))
    assert ids.tolist() == list(range(bs * topk))
    # Make request 1 prefer its branch 1 and request 2 its branch 0 at the next level.
    child_p = torch.tensor(
        [[0.5, 0.4], [0.3, 0.2], [0.1, 0.05], [0.9, 0.8], [0.7, 0.6], [0.01, 0.02]]
    )
    child_ids = torch.arange(100, 100 + bs * topk * topk).view(bs * topk, topk)
    draft_hidden = torch.randn(bs * topk, hidden_size, generator=gen)
    ids, new_hidden, new_scores = select_next_level(
        scores, child_p, child_ids, draft_hidden, 1, record
    )
    for b in range(bs):
        expand = [
            (float(scores[b, r] * child_p[b * topk + r, c]), r, c)
            for r in range(topk)
            for c in range(topk)
        ]
        best = sorted(expand, reverse=True)[:topk]
        for j, (score, r, c) in enumerate(best):
            row = b * topk + j
            assert ids[row] == child_ids[b * topk + r, c]
            assert torch.equal(new_hidden[row], draft_hidden[b * topk + r])  # per-request offset
            assert abs(float(new_scores[b, j]) - score) < 1e-6
            assert record.parents[1][b, j] == topk + r * topk + c


def test_organize_selects_best_scores():
    topk, steps, nd = 3, 3, 9
    record = run_draft_loop(4, topk, steps, 40, seed=1)
    top, draft_tokens, parent_list = organize_draft(record, nd, topk, steps)
    assert parent_list.shape == (4, topk * (steps - 1) + 1)
    for b in range(4):
        flat = [float(x) for s in record.scores for x in s[b].flatten()]
        tokens = [int(x) for t in record.tokens for x in t[b]]
        best = sorted(range(len(flat)), key=lambda i: -flat[i])[: nd - 1]
        assert top[b].tolist() == sorted(best)
        assert draft_tokens[b].tolist() == [tokens[i] for i in sorted(best)]


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_chain_tree_equals_the_general_construction(steps):
    """A chain draft loop's tree from constants (`tree_from_draft`'s fast path) equals the
    general selection and construction (`organize_draft` + `build_tree`)."""
    from gpu_worker.speculative.tree import DraftShape, tree_from_draft

    bs = 3
    record = run_draft_loop(bs, 1, steps, 30, seed=steps)
    bonus, committed_lens = torch.tensor([1, 2, 3]), torch.tensor([4, 9, 17])
    top, draft_tokens, parent_list = organize_draft(record, steps + 1, 1, steps)
    general = build_tree(bonus, parent_list, top, draft_tokens, committed_lens, 1, steps, steps + 1)
    chain = tree_from_draft(record, bonus, committed_lens, DraftShape(1, steps, steps + 1))
    for name in TREE_FIELDS:
        assert torch.equal(getattr(chain, name), getattr(general, name)), name
    for b in range(bs):
        assert parents_of(chain, b) == list(range(-1, steps))


def test_accept_inputs_carry_every_tensor_of_the_tree():
    """The stage buffers' tree fields are `DraftTree`'s tensors, and round-trip through
    `tree_fields` and `AcceptInputs.tree`."""
    from gpu_worker.speculative import stage_buffers
    from gpu_worker.speculative.tree import DraftShape, chain_tree

    assert stage_buffers.TREE_FIELDS == TREE_FIELDS
    assert set(stage_buffers.TREE_MASKS) < set(TREE_FIELDS)
    tree = chain_tree(torch.tensor([1, 2]), torch.tensor([[3, 4], [5, 6]]), torch.tensor([4, 9]), 2)
    bs, nd = 2, 3
    inputs = stage_buffers.AcceptInputs(
        rows=torch.tensor([1, 2]),
        committed_lens=torch.tensor([4, 9]),
        **stage_buffers.tree_fields(tree),
        logits=torch.zeros(bs * nd, 5),
        features=torch.zeros(bs * nd, 2),
    )
    again = inputs.tree(DraftShape(1, 2, nd))
    assert (again.topk, again.num_steps, again.num_draft_tokens) == (1, 2, nd)
    for name in TREE_FIELDS:
        assert torch.equal(getattr(again, name), getattr(tree, name)), name
