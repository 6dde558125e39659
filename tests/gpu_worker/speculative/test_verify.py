from __future__ import annotations

import pytest
import torch

from gpu_worker.speculative.tree import DraftTree
from gpu_worker.speculative.verify import (
    accepted_tokens,
    verify_greedy,
    verify_sampling,
)
from tests.gpu_worker.speculative.trees import greedy_target_for_paths, path_to, random_tree

# Chi-square critical values at p = 1e-4 by degrees of freedom (fixed seeds make it repeatable).
CHI2_CRIT = {3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88}


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


def one_hot_probs(target: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(target, vocab).to(torch.float32)


@pytest.mark.parametrize("seed", [0, 1])
def test_spec_sampling_thresholds(seed):
    # One-hot target rows (greedy requests) reproduce greedy verification for any coins.
    gen = torch.Generator().manual_seed(seed)
    tree = kernel_vector_tree()
    probs = one_hot_probs(KERNEL_TARGET, 20)
    sampled = verify_sampling(
        tree, probs, torch.rand(2, 6, generator=gen), torch.rand(2, generator=gen)
    )
    greedy = verify_greedy(tree, KERNEL_TARGET)
    for name in ("predict", "accept_index", "num_correct", "accept_lens"):
        assert torch.equal(getattr(sampled, name), getattr(greedy, name)), name

    # Random trees whose targets accept paths of every depth.
    bs, topk, steps, nd, vocab = 4, 3, 3, 8, 40
    tree = random_tree(bs, topk, steps, nd, vocab=vocab, seed=seed, sharpness=3.0)
    paths = [path_to(tree, b, int(tree.depth[b].argmax()) if b % 2 else 0) for b in range(bs)]
    target = greedy_target_for_paths(tree, paths, [vocab + 1 + b for b in range(bs)])
    target = torch.where(target < 0, vocab + 10, target)  # a token no draft carries
    sampled = verify_sampling(
        tree,
        one_hot_probs(target, vocab + 20),
        torch.rand(bs, nd, generator=gen),
        torch.rand(bs, generator=gen),
    )
    greedy = verify_greedy(tree, target)
    assert torch.equal(sampled.predict, greedy.predict)
    assert torch.equal(sampled.accept_index, greedy.accept_index)
    assert greedy.accept_lens.tolist() == [len(p) for p in paths]


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)
    expected = probs.to(torch.float64) * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def replicate(tree: DraftTree, copies: int) -> DraftTree:
    """The same single-request tree `copies` times (one draw per copy)."""
    nd = tree.num_draft_tokens
    return DraftTree(
        tokens=tree.tokens.repeat(copies),
        positions=tree.positions.repeat(copies),
        custom_mask=tree.custom_mask,
        retrieve_index=torch.arange(copies * nd).view(copies, nd),
        next_token=tree.next_token.repeat(copies, 1),
        next_sibling=tree.next_sibling.repeat(copies, 1),
        depth=tree.depth.repeat(copies, 1),
        topk=tree.topk,
        num_steps=tree.num_steps,
        num_draft_tokens=nd,
    )


@pytest.mark.parametrize("duplicate_siblings", [False, True])
def test_spec_sampling_matches_target_distribution(duplicate_siblings):
    vocab, topk, steps, nd, draws = 6, 2, 2, 5, 40000
    gen = torch.Generator().manual_seed(7)
    base = random_tree(1, topk, steps, nd, vocab=vocab, seed=5, committed_lens=[1])
    assert int(base.depth.max()) == 2  # a 2-level tree
    if duplicate_siblings:  # exactness must not depend on distinct sibling tokens
        tokens = base.tokens.clone()
        kids = [k for k in range(1, nd) if base.depth[0, k] == 1]
        tokens[kids[1]] = tokens[kids[0]]
        base = DraftTree(**{**base.__dict__, "tokens": tokens})
    tree = replicate(base, draws)
    node_probs = torch.rand(nd, vocab, generator=gen) + 0.1  # one target distribution per node
    node_probs = node_probs / node_probs.sum(-1, keepdim=True)
    probs = node_probs.repeat(draws, 1)
    result = verify_sampling(
        tree, probs, torch.rand(draws, nd, generator=gen), torch.rand(draws, generator=gen)
    )
    emitted = accepted_tokens(result)  # [draws, S+1]
    assert chi_square(emitted[:, 0], node_probs[0]) < CHI2_CRIT[vocab - 1]

    # Given that the first token is root child k's token, the second follows the target at k.
    tokens = base.tokens.tolist()
    checked = 0
    for k in range(1, nd):
        if base.depth[0, k] != 1 or tokens[k] in tokens[1:k]:
            continue
        given = emitted[:, 0] == tokens[k]
        assert bool((result.accept_lens[given] >= 2).all())
        assert chi_square(emitted[given, 1], node_probs[k]) < CHI2_CRIT[vocab - 1]
        checked += 1
    assert checked >= 1


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


@pytest.mark.parametrize("seed", range(4))
def test_sampling_chain_fast_path_equals_the_tree_walk(seed):
    """Random chains, random target distributions over a small vocabulary (some tokens at
    probability 0) and random coins: the chain fast path accepts, and samples the token after
    the run, exactly as the level-by-level walk does (every accept length occurs)."""
    from gpu_worker.speculative.tree import chain_tree
    from gpu_worker.speculative.verify import verify_sampling_chain, verify_sampling_walk

    gen = torch.Generator().manual_seed(seed)
    bs, steps, vocab = 256, 4, 3
    drafts = torch.randint(0, vocab, (bs, steps), generator=gen)
    tree = chain_tree(
        torch.randint(0, vocab, (bs,), generator=gen),
        drafts,
        torch.randint(1, 30, (bs,), generator=gen),
        steps,
    )
    probs = torch.rand(bs, steps + 1, vocab, generator=gen)
    probs = probs * (torch.rand(bs, steps + 1, vocab, generator=gen) > 0.2)  # some zeros
    probs[..., 0] += 1e-3  # no all-zero row
    probs = probs / probs.sum(-1, keepdim=True)
    coins = torch.rand(bs, steps + 1, generator=gen)
    final = torch.rand(bs, generator=gen)
    fast = verify_sampling_chain(tree, probs, coins, final)
    walk = verify_sampling_walk(tree, probs, coins, final)
    for name in ("predict", "accept_index", "num_correct", "accept_lens"):
        assert torch.equal(getattr(fast, name), getattr(walk, name)), name
    assert set(fast.accept_lens.tolist()) == set(range(1, steps + 2))
