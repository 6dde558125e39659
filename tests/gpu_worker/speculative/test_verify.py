from __future__ import annotations

import pytest
import torch

from gpu_worker.speculative.tree import DraftTree
from gpu_worker.speculative.verify import accepted_tokens, verify_greedy
from tests.gpu_worker.speculative.trees import greedy_target_for_paths, path_to, random_tree


def kernel_vector_tree() -> DraftTree:
    """A greedy-verify vector (the public SGLang kernel test's): bs=2, ND=6, S=3 (child lists not
    ascending)."""
    nd = 6
    return DraftTree(
        tokens=torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 11, 12]),
        positions=torch.zeros(2 * nd, dtype=torch.int64),
        custom_mask=torch.ones(0, 0, 0, dtype=torch.bool),
        retrieve_index=torch.arange(2 * nd).view(2, nd),
        next_token=torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        next_sibling=torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        depth=torch.zeros(2, nd, dtype=torch.int64),
        topk=2,
        num_steps=3,
        num_draft_tokens=nd,
    )


KERNEL_TARGET = torch.tensor([3, 18, 18, 4, 5, 18, 11, 18, 18, 18, 12, 18])
KERNEL_PREDICT = [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]  # kernel test initialises -1


def test_verify_greedy_vector():
    result = verify_greedy(kernel_vector_tree(), KERNEL_TARGET)
    assert result.predict.tolist() == [max(x, 0) for x in KERNEL_PREDICT]
    assert result.accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert result.num_correct.tolist() == [3, 2]
    assert result.accept_lens.tolist() == [4, 3]
    assert result.predict.dtype == result.accept_index.dtype == torch.int64
    assert accepted_tokens(result).tolist() == [[3, 4, 5, 18], [11, 12, 18, 0]]


def test_bonus_stride():
    bs, topk, steps, nd, vocab = 3, 4, 3, 8, 50
    tree = random_tree(bs, topk, steps, nd, vocab=vocab, seed=4, sharpness=3.0)
    deepest = [int(tree.depth[b].argmax()) for b in range(bs)]
    assert int(tree.depth[1].max()) >= 2
    paths = [path_to(tree, 0, 0), path_to(tree, 1, deepest[1]), path_to(tree, 2, 1)]
    bonus = [1000, 1001, 1002]
    result = verify_greedy(tree, greedy_target_for_paths(tree, paths, bonus))
    assert result.accept_lens.tolist() == [len(p) for p in paths]
    assert len(set(result.accept_lens.tolist())) == 3
    emitted = accepted_tokens(result)  # the bonus is each row's last valid entry, stride S+1
    tokens = tree.tokens.view(bs, nd)
    for b, path in enumerate(paths):
        expected = [int(tokens[b, k]) for k in path[1:]] + [bonus[b]]
        assert emitted[b, : len(path)].tolist() == expected
        assert emitted[b, len(path) :].tolist() == [0] * (steps + 1 - len(path))
        assert result.accept_index[b, : len(path)].tolist() == [b * nd + k for k in path]


@pytest.mark.parametrize("seed", range(4))
def test_greedy_chain_fast_path_equals_the_tree_walk(seed):
    """Random chains against random target argmaxes (every accept length occurs): the chain
    fast path gives the level-by-level walk's result."""
    from gpu_worker.speculative.tree import chain_tree
    from gpu_worker.speculative.verify import verify_greedy_chain, verify_greedy_walk

    gen = torch.Generator().manual_seed(seed)
    bs, steps = 16, 4
    drafts = torch.randint(0, 3, (bs, steps), generator=gen)  # small vocab: many matches
    tree = chain_tree(
        torch.randint(0, 3, (bs,), generator=gen),
        drafts,
        torch.randint(1, 30, (bs,), generator=gen),
        steps,
    )
    # The target agrees with the drafts up to a random cut, then disagrees once.
    target = torch.cat([drafts, torch.randint(0, 3, (bs, 1), generator=gen)], dim=1)
    cut = torch.randint(0, steps + 1, (bs,), generator=gen)
    rows = torch.arange(bs)
    target[rows, cut] = torch.where(cut < steps, (target[rows, cut] + 1) % 3, target[rows, cut])
    fast, walk = verify_greedy_chain(tree, target), verify_greedy_walk(tree, target)
    for name in ("predict", "accept_index", "num_correct", "accept_lens"):
        assert torch.equal(getattr(fast, name), getattr(walk, name)), name
    assert fast.accept_lens.tolist() == (cut + 1).tolist()
