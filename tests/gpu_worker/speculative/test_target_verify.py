"""Acceptance against the verify logits: penalties count the drafts on each node's own path;
the accept stages' fixed sampling stages accept what each batch's own stages do; logprobs."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from aerie.messages import SamplingParams
from gpu_worker.sampling import SamplingState
from gpu_worker.speculative.compaction import compact_rows
from gpu_worker.speculative.iteration import ACCEPT_FLAGS, SpeculativeWorker
from gpu_worker.speculative.target_verify import accept_and_read, node_draws
from gpu_worker.speculative.tree import build_tree
from gpu_worker.speculative.verify import accepted_tokens, verify_greedy
from tests.gpu_worker.speculative.trees import random_tree


def test_penalties_count_the_drafts_on_each_nodes_path():
    """Chain root 3 -> 5 -> 5; the target prefers 5 over 6 by 0.5 everywhere. With a frequency
    penalty of 1, plain decoding emits 5 then 6 (5 was just emitted); so must verification."""
    vocab, steps = 8, 2
    sampling = SamplingState(2, vocab, "cpu")
    sampling.start(1, SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], 0)
    tree = build_tree(
        torch.tensor([3]),
        torch.tensor([[-1, 0]]),
        torch.tensor([[0, 1]]),
        torch.tensor([[5, 5]]),
        torch.tensor([4]),
        1,
        steps,
        steps + 1,
    )
    logits = torch.zeros(steps + 1, vocab)
    logits[:, 5], logits[:, 6] = 1.0, 0.5
    draws, _ = node_draws(sampling, tree, logits, torch.tensor([1]), np.array([1]))
    result = verify_greedy(tree, draws)
    path = result.accept_index[0][result.accept_index[0] >= 0]
    spec = result.predict[path].tolist()
    plain = []
    for _ in range(steps + 1):
        rows = torch.tensor([1])
        penalised = sampling.penalize(logits[:1].clone(), rows, sampling.gather(rows))
        plain.append(int(penalised.argmax()))
        sampling.observe(rows, torch.tensor([plain[-1]]))
    assert spec == plain[: len(spec)] == [5, 6]


def read(sampling, tree, logits, rows, variant):
    """`accept_and_read` with accept variant `variant`'s stages; node k's feature is k."""
    features = torch.arange(logits.shape[0], dtype=torch.float32)[:, None]
    return accept_and_read(sampling, tree, logits, features, rows, ACCEPT_FLAGS[variant])


def tree_and_logits(seed: int, bs: int, vocab: int):
    """Random trees (topk 2, S 3, ND 6) and verify logits [bs*ND, V] that favour each node's
    children, so that several drafts get accepted."""
    tree = random_tree(bs, 2, 3, 6, vocab=vocab - bs, seed=seed)  # bonus ids up to vocab - 1
    logits = 2 * torch.randn(bs * 6, vocab, generator=torch.Generator().manual_seed(seed))
    kids = tree.tokens.view(bs, 1, 6).expand(bs, 6, 6)
    logits.view(bs, 6, vocab).scatter_add_(2, kids, torch.full((bs, 6, 6), 3.0))
    return tree, logits


REQUESTS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=3),
    SamplingParams(temperature=1.2, top_p=0.7, seed=4),
    SamplingParams(temperature=0.6, top_k=5, min_p=0.05, seed=5),
    SamplingParams(temperature=0.9, frequency_penalty=0.5, presence_penalty=0.3, seed=6),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
]


@pytest.mark.parametrize("rows", [[1, 2], [1, 3], [1, 2, 3, 4], [2, 3, 4, 5, 6, 1], [1], [6, 2]])
def test_fixed_stages_accept_what_the_batchs_own_stages_do(rows):
    """The accept stage graphs run fixed sampling stages (`ACCEPT_FLAGS`); for any batch the
    variant `accept_variant` picks gives every row the tokens, accept lengths and logprobs
    of acceptance with exactly the stages its rows use, and so does the variant with every
    stage on."""
    vocab = 40
    sampling = SamplingState(8, vocab, "cpu")
    for row, params in enumerate(REQUESTS, start=1):
        sampling.start(row, params, [row, 7, 9], 0)
        sampling.observe(torch.tensor([row]), torch.tensor([row + 3]))
    tree, logits = tree_and_logits(seed=len(rows), bs=len(rows), vocab=vocab)
    index, rows_cpu = torch.tensor(rows), np.array(rows)
    draws, scores = node_draws(sampling, tree, logits, index, rows_cpu)
    exact = verify_greedy(tree, draws)
    tokens = accepted_tokens(exact)
    logprobs = torch.log_softmax(compact_rows(scores, exact), -1).gather(1, tokens.view(-1, 1))
    worker = SimpleNamespace(sampling=sampling)
    picked = SpeculativeWorker.accept_variant(worker, rows_cpu, want_logprobs=True)
    for variant in {picked, "penalize"}:
        result, step, features = read(sampling, tree, logits, index, variant)
        assert torch.equal(result.accept_index, exact.accept_index), variant
        # Each accepted node's target feature (here its global id) lands on its path slot.
        path = exact.accept_index.clamp(min=0).flatten().float()
        accepted = exact.accept_index.flatten() >= 0
        assert torch.equal(features[accepted, 0], path[accepted])
        assert torch.equal(step.tokens, tokens) and torch.equal(step.accept_lens, exact.accept_lens)
        torch.testing.assert_close(step.logprobs, logprobs.view_as(tokens))
    assert exact.accept_lens.sum() > len(rows)  # some drafts were accepted


def test_a_greedy_row_of_a_sampled_batch_gets_its_logprobs_as_plain_decoding_does():
    """Logprobs of a greedy row are the log-softmax of its logits at temperature 1, whatever
    its batch; those of a sampled row the log of the processed distribution it drew from."""
    vocab = 40
    sampling = SamplingState(4, vocab, "cpu")
    sampling.start(1, SamplingParams(temperature=0.0), [1], 0)
    sampling.start(2, SamplingParams(temperature=0.5, seed=1), [1], 0)
    tree, logits = tree_and_logits(seed=0, bs=2, vocab=vocab)
    result, step, _ = read(sampling, tree, logits, torch.tensor([1, 2]), "sample")
    for b, temperature in ((0, 1.0), (1, 0.5)):
        nodes = result.accept_index[b][: int(step.accept_lens[b])]
        want = torch.log_softmax(logits[nodes] / temperature, -1)
        want = want.gather(1, step.tokens[b, : len(nodes), None]).squeeze(1)
        torch.testing.assert_close(step.logprobs[b, : len(nodes)], want)
    greedy_nodes = result.accept_index[0][: int(step.accept_lens[0])]
    assert torch.equal(step.tokens[0, : len(greedy_nodes)], logits[greedy_nodes].argmax(-1))


def children(tree, b: int, node: int) -> list[int]:
    """Local ids of node's children in request b's tree, in list order."""
    kids, kid = [], int(tree.next_token[b, node])
    while kid != -1:
        kids.append(kid)
        kid = int(tree.next_sibling[b, kid])
    return kids


@pytest.mark.parametrize("seed", range(3))
def test_sampled_acceptance_emits_what_plain_decoding_draws(seed):
    """Walking each tree as plain decoding would (draw the next token with
    `SamplingState.sample` at the node's position, move to the child carrying it, else stop)
    gives exactly the tokens acceptance emits, for greedy, sampled, filtered and penalised
    requests alike: a seeded request's output does not depend on whether it speculates."""
    vocab, rows = 40, [1, 2, 3, 4, 5, 6]
    sampling = SamplingState(8, vocab, "cpu")
    for row, params in enumerate(REQUESTS, start=1):
        sampling.start(row, params, [row, 7, 9], 0)
    tree, logits = tree_and_logits(seed=seed, bs=len(rows), vocab=vocab)
    nd = tree.num_draft_tokens
    for b in range(len(rows)):  # each node's children likely: several drafts get accepted
        for node in range(nd):
            for kid in children(tree, b, node):
                logits[b * nd + node, tree.tokens[b * nd + kid]] += 4.0
    _, step, _ = read(sampling, tree, logits, torch.tensor(rows), "penalize")
    positions = tree.positions.view(len(rows), -1)
    for b, row in enumerate(rows):
        node, plain = 0, []
        while True:
            token, _ = sampling.sample(
                logits[b * nd + node][None], torch.tensor([row]), positions[b, node][None] + 1
            )
            plain.append(int(token))
            sampling.observe(torch.tensor([row]), token)
            hits = [k for k in children(tree, b, node) if int(tree.tokens[b * nd + k]) == plain[-1]]
            if not hits:
                break
            node = hits[0]
        assert step.tokens[b, : int(step.accept_lens[b])].tolist() == plain, b
    assert step.accept_lens.sum() > 2 * len(rows)  # drafts were accepted


# Chi-square critical values at p = 1e-4 by degrees of freedom (fixed seeds make it repeatable).
CHI2_CRIT = {5: 25.74}


def chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)
    expected = probs.to(torch.float64) * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("topk, steps, nd", [(1, 3, 4), (2, 2, 5)])
def test_sampled_acceptance_follows_the_target_distribution(topk, steps, nd):
    """One tree and one target distribution per node, drawn with 20,000 seeds: the first
    emitted token follows the root's distribution, and given that it is a child's token the
    next follows that child's (chains and trees)."""
    vocab, draws = 6, 20000
    gen = torch.Generator().manual_seed(7)
    sampling = SamplingState(draws, vocab, "cpu")
    for row in range(1, draws + 1):
        sampling.start(row, SamplingParams(temperature=1.0, seed=row), [0], 0)
    base = random_tree(1, topk, steps, nd, vocab=vocab, seed=5, committed_lens=[1])
    base = dataclasses.replace(base, tokens=base.tokens % vocab)  # the bonus id is in vocab
    tree = replicate(base, draws)
    node_logits = torch.randn(nd, vocab, generator=gen)
    logits = node_logits.repeat(draws, 1)
    _, step, _ = read(sampling, tree, logits, torch.arange(1, draws + 1), "sample")
    node_probs = torch.softmax(node_logits, -1)
    assert chi_square(step.tokens[:, 0], node_probs[0]) < CHI2_CRIT[vocab - 1]
    tokens = base.tokens.tolist()
    for k in children(base, 0, 0):
        given = step.tokens[:, 0] == tokens[k]
        assert bool((step.accept_lens[given] >= 2).all())
        assert chi_square(step.tokens[given, 1], node_probs[k]) < CHI2_CRIT[vocab - 1]


def replicate(tree, copies: int):
    """The same single-request tree `copies` times (one draw per copy)."""
    nd = tree.num_draft_tokens
    return dataclasses.replace(
        tree,
        tokens=tree.tokens.repeat(copies),
        positions=tree.positions.repeat(copies),
        retrieve_index=torch.arange(copies * nd).view(copies, nd),
        next_token=tree.next_token.repeat(copies, 1),
        next_sibling=tree.next_sibling.repeat(copies, 1),
        depth=tree.depth.repeat(copies, 1),
        ancestors=None if tree.ancestors is None else tree.ancestors.repeat(copies, 1, 1),
    )
