"""Greedy acceptance in one launch against `verify_greedy` + `accepted_tokens` +
`compact_rows`: random trees of every shape the draft loop makes, random chains, and targets
that accept a chosen path (every accept length occurs)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gpu_worker.kernels.greedy_accept import greedy_accept, greedy_accept_reference
from gpu_worker.speculative.stage_buffers import Accepted
from gpu_worker.speculative.tree import chain_tree
from tests.devices import triton_devices
from tests.gpu_worker.speculative.trees import greedy_target_for_paths, path_to, random_tree

NAMES = ("predict", "accept_index", "accept_lens", "tokens", "features")


def check(tree, target, features, device):
    """The kernel's results, poisoned buffers given to write in place, equal the reference's."""
    tensors = {f.name: getattr(tree, f.name) for f in dataclasses.fields(tree)}
    tree = dataclasses.replace(
        tree,
        **{
            name: value.to(device)
            for name, value in tensors.items()
            if isinstance(value, torch.Tensor)
        },
    )
    target, features = target.to(device), features.to(device)
    want = greedy_accept_reference(tree, target, features)
    bs, width = want[3].shape
    given = Accepted(
        accept_lens=torch.full_like(want[2], 99),
        tokens=torch.full_like(want[3], 99),
        features=torch.full(
            (bs, width, features.shape[1]), 7.0, dtype=features.dtype, device=device
        ),
    )
    got = greedy_accept(tree, target, features, out=given)
    for name, a, b in zip(NAMES, got, want, strict=True):
        assert torch.equal(a.cpu(), b.cpu()), name
    for buffer, index in ((given.accept_lens, 2), (given.tokens, 3), (given.features, 4)):
        assert got[index].data_ptr() == buffer.data_ptr(), NAMES[index]  # written in place
    return got


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("topk, steps, nd", [(1, 3, 4), (2, 3, 6), (4, 4, 8), (3, 5, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_trees_accept_the_chosen_path(device, topk, steps, nd, seed):
    bs = 6
    tree = random_tree(bs, topk, steps, nd, vocab=12, seed=seed)  # small vocab: equal siblings
    rng = random.Random(seed)
    paths = [path_to(tree, b, rng.randrange(nd)) for b in range(bs)]
    target = greedy_target_for_paths(tree, paths, [1000 + b for b in range(bs)])
    features = torch.randn(bs * nd, 300)  # not a multiple of the copy block
    got = check(tree, target, features, device)
    assert got[2].tolist() == [len(p) for p in paths]


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chains_against_random_argmaxes(device, dtype):
    """Tiny vocabulary: drafts and argmaxes often agree, so every accept length occurs."""
    gen = torch.Generator().manual_seed(0)
    bs, steps = 32, 3
    drafts = torch.randint(0, 2, (bs, steps), generator=gen)
    tree = chain_tree(
        torch.randint(0, 2, (bs,), generator=gen),
        drafts,
        torch.randint(1, 30, (bs,), generator=gen),
        steps,
    )
    target = torch.randint(0, 2, (bs * (steps + 1),), generator=gen)
    got = check(tree, target, torch.randn(bs * (steps + 1), 1100).to(dtype), device)
    assert set(got[2].tolist()) == {1, 2, 3, 4}
