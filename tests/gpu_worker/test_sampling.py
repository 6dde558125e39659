"""Sampling: greedy parity, seeded batch invariance, exact distributions, filters, penalties."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from aerie.messages import SamplingParams
from gpu_worker.sampling import (
    STREAM_TOKEN,
    SamplingState,
    column_hashes,
    fixed_flags,
    process_logits,
    row_keys,
    uniform_from_keys,
)

VOCAB = 16


def make_state(max_rows: int = 8, vocab: int = VOCAB) -> SamplingState:
    return SamplingState(max_rows, vocab, "cpu")


def draw_many(state: SamplingState, row: int, logits: torch.Tensor, num: int):
    """num independent draws for one row: the same logits at positions 0..num-1."""
    batch = logits[None, :].expand(num, -1).contiguous()
    rows = torch.full((num,), row, dtype=torch.int64)
    return state.sample(batch, rows, torch.arange(num))


def assert_matches_distribution(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    """Chi-square goodness of fit over the support of probs; nothing outside the support."""
    support = probs > 0
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    assert observed[~support].sum() == 0, "emitted a token with zero probability"
    expected = probs[support].double() * tokens.numel()
    stat = ((observed[support] - expected) ** 2 / expected).sum().item()
    dof = int(support.sum()) - 1
    if dof > 0:
        assert stat < chi2.ppf(0.9999, dof), f"chi-square {stat:.1f} with {dof} dof"


def reference_filter(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float
) -> torch.Tensor:
    """Straightforward loop-based top-k, top-p (on the top-k renormalised probs), min-p."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[i] for i in kept)
    nucleus, acc = [], 0.0
    for i in kept:
        if acc >= top_p * mass and top_p < 1.0:
            break
        nucleus.append(i)
        acc += probs[i]
    top = max(probs)
    final = [i for i in nucleus if probs[i] >= min_p * top]
    out = torch.zeros(len(probs), dtype=torch.float64)
    for i in final:
        out[i] = probs[i]
    return out / out.sum()


def reference_penalties(
    logits: list[float], prompt: list[int], outputs: list[int], rep: float, freq: float, pres: float
) -> list[float]:
    out = list(logits)
    for tok in set(prompt) | set(outputs):
        out[tok] = out[tok] / rep if out[tok] > 0 else out[tok] * rep
    for tok in set(outputs):
        count = outputs.count(tok)
        out[tok] -= freq * count + pres
    return out


def test_greedy_is_exact_argmax_in_a_mixed_batch():
    state = make_state()
    state.start(1, SamplingParams(temperature=0.0), [1, 2], 0)
    state.start(2, SamplingParams(temperature=1.0, top_k=1), [3], 0)
    state.start(3, SamplingParams(temperature=1.5, seed=5), [3], 0)
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    tokens, logprobs = state.sample(logits, torch.tensor([1, 2, 3]), torch.tensor([4, 4, 4]))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert torch.equal(tokens[:2], logits[:2].argmax(-1))
    raw = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[:2], raw[:2])


def test_all_greedy_batch_is_argmax():
    state = make_state()
    for row in (1, 2, 3):
        state.start(row, SamplingParams(temperature=0.0), [1], 0)
    logits = torch.randn(5, VOCAB)
    tokens, _ = state.sample(logits, torch.tensor([1, 2, 3, 1, 2]), torch.arange(5))
    assert torch.equal(tokens, logits.argmax(-1))


def test_same_seed_and_position_give_same_token_across_batches():
    vocab = 1000
    state = make_state(vocab=vocab)
    for row in range(1, 6):
        state.start(row, SamplingParams(temperature=1.0, seed=100 + row), [1], 0)
    torch.manual_seed(1)
    logits = torch.randn(6, vocab)  # row r uses logits[r]
    positions = torch.tensor([0, 7, 3, 9, 12, 5])

    def run(rows: list[int]) -> dict[int, int]:
        idx = torch.tensor(rows)
        tokens, _ = state.sample(logits[idx], idx, positions[idx])
        return dict(zip(rows, tokens.tolist(), strict=True))

    full = run([1, 2, 3, 4, 5])
    assert run([5, 3, 1, 4, 2]) == full
    assert run([4]) == {4: full[4]}
    assert run([2, 5]) == {r: full[r] for r in (2, 5)}
    # Same seed on another row (a restart elsewhere) reproduces the token too.
    state.start(6, SamplingParams(temperature=1.0, seed=103), [9], 0)
    tokens, _ = state.sample(logits[3:4], torch.tensor([6]), positions[3:4])
    assert tokens.item() == full[3]


def test_a_rows_draw_and_logprob_do_not_depend_on_its_batch_with_filters():
    """Top-k, top-p, min-p and greedy rows side by side: the filters switched on for the batch
    leave a row that asks for none as it is, and each row draws the same token with the same
    logprob alone, in any order and beside any others (the deterministic mode's sampling)."""
    vocab = 1000
    state = make_state(vocab=vocab)
    params = {
        1: SamplingParams(temperature=0.7, seed=11),
        2: SamplingParams(temperature=0.7, seed=12, top_p=0.9),
        3: SamplingParams(temperature=1.0, seed=13, top_k=20),
        4: SamplingParams(temperature=0.7, seed=14, min_p=0.05),
        5: SamplingParams(temperature=0.0),
        6: SamplingParams(temperature=1.3, seed=16, top_k=50, top_p=0.8, min_p=0.01),
    }
    for row, p in params.items():
        state.start(row, p, [1], 0)
    torch.manual_seed(2)
    logits = torch.randn(7, vocab) * 3  # row r reads logits[r]
    positions = torch.tensor([0, 4, 8, 15, 16, 23, 42])

    def run(rows: list[int]) -> dict[int, tuple[int, float]]:
        idx = torch.tensor(rows)
        tokens, logprobs = state.sample(logits[idx], idx, positions[idx])
        pairs = zip(tokens.tolist(), logprobs.tolist(), strict=True)
        return dict(zip(rows, pairs, strict=True))

    full = run(list(params))
    for row in params:
        assert run([row]) == {row: full[row]}, f"row {row} alone"
    assert run([6, 4, 2, 5, 3, 1]) == full
    assert run([1, 5]) == {r: full[r] for r in (1, 5)}  # no filter in this batch
    assert full[5][0] == int(logits[5].argmax())


def test_different_seeds_differ_and_equal_seeds_agree():
    vocab = 1000
    state = make_state(vocab=vocab)
    state.start(1, SamplingParams(temperature=1.0, seed=1), [1], 0)
    state.start(2, SamplingParams(temperature=1.0, seed=2), [1], 0)
    state.start(3, SamplingParams(temperature=1.0, seed=1), [1], 0)
    logits = torch.zeros(vocab)
    a, _ = draw_many(state, 1, logits, 64)
    b, _ = draw_many(state, 2, logits, 64)
    c, _ = draw_many(state, 3, logits, 64)
    assert (a != b).sum() > 50
    assert torch.equal(a, c)


def test_a_sampled_request_without_a_seed_is_refused():
    """The frontend gives every request a seed; a sampled row without one would share a
    fallback noise with every other such row. Greedy rows draw no noise and need none."""
    state = make_state()
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(presence_penalty=0.5),
        SamplingParams(temperature=0.3, top_k=5),
    ):
        with pytest.raises(ValueError, match="has no seed"):
            state.start(1, params, [1], 0)
    state.start(1, SamplingParams(temperature=0.0), [1], 0)
    state.start(2, SamplingParams(temperature=1.0, top_k=1), [1], 0)
    logits = torch.randn(2, VOCAB)
    tokens, _ = state.sample(logits, torch.tensor([1, 2]), torch.tensor([3, 3]))
    assert torch.equal(tokens, logits.argmax(-1))


@pytest.mark.parametrize("temperature", [1.0, 0.6, 2.0])
def test_sampled_frequencies_match_softmax(temperature):
    state = make_state()
    state.start(1, SamplingParams(temperature=temperature, seed=11), [1], 0)
    logits = torch.linspace(-2.0, 2.0, VOCAB)
    tokens, _ = draw_many(state, 1, logits, 20000)
    assert_matches_distribution(tokens, torch.softmax(logits.double() / temperature, -1))


@pytest.mark.parametrize(
    "top_k,top_p,min_p",
    [(4, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.2), (6, 0.8, 0.1), (1, 1.0, 0.0)],
)
def test_filters_keep_renormalised_proportions(top_k, top_p, min_p):
    state = make_state()
    params = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    state.start(1, params, [1], 0)
    torch.manual_seed(2)
    logits = torch.randn(VOCAB) * 1.5
    expected = reference_filter(logits, 0.8, top_k, top_p, min_p)
    assert (expected > 0).sum() < VOCAB  # the filter removes something
    tokens, logprobs = draw_many(state, 1, logits, 20000)
    assert_matches_distribution(tokens, expected)
    if top_k != 1:
        torch.testing.assert_close(logprobs.double(), expected.log()[tokens], atol=1e-5, rtol=0)


def test_processed_logits_match_reference_and_leave_greedy_rows_alone():
    state = make_state()
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, seed=1)
    state.start(1, params, [1], 0)
    state.start(2, SamplingParams(temperature=0.0), [1], 0)
    logits = torch.randn(2, VOCAB) * 2
    rows = state.gather(torch.tensor([1, 2]))
    processed = process_logits(logits, rows)
    probs = torch.softmax(processed[0], -1)
    torch.testing.assert_close(probs.double(), reference_filter(logits[0], 0.7, 5, 0.9, 0.05))
    # the greedy row's logits are its own (its logprobs are those of the raw distribution)
    assert torch.equal(processed[1], logits[1])
    repeated = rows.repeat_interleave(3)
    assert repeated.temperature.tolist() == pytest.approx([0.7] * 3 + [0.0] * 3)


def test_penalties_match_reference():
    vocab = 12
    state = make_state(vocab=vocab)
    cases = {1: (1.3, 0.5, 0.25), 2: (0.8, 0.0, 1.0), 3: (1.0, 0.0, 0.0), 4: (1.0, 0.7, 0.0)}
    prompts = {1: [0, 1, 2, 2], 2: [5, 6], 3: [1, 2], 4: [7]}
    outputs = {1: [3, 3, 4], 2: [5, 9, 9, 9], 3: [4], 4: [7, 8, 8]}
    for row, (rep, freq, pres) in cases.items():
        params = SamplingParams(
            temperature=0.0, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres
        )
        state.start(row, params, prompts[row], 0)
    for step in range(4):  # outputs arrive one decode step at a time
        rows = [r for r in cases if step < len(outputs[r])]
        state.observe(torch.tensor(rows), torch.tensor([outputs[r][step] for r in rows]))
    torch.manual_seed(3)
    logits = torch.randn(4, vocab) * 2
    index = torch.tensor([1, 2, 3, 4])
    got = state.penalize(logits, index, state.gather(index))
    for b, row in enumerate(cases):
        want = reference_penalties(logits[b].tolist(), prompts[row], outputs[row], *cases[row])
        torch.testing.assert_close(got[b], torch.tensor(want))
    tokens, _ = state.sample(logits, index, torch.zeros(4, dtype=torch.int64))
    assert torch.equal(tokens, got.argmax(-1))


def test_penalty_free_batches_skip_penalty_work():
    state = make_state()
    state.start(1, SamplingParams(temperature=1.0, seed=1), [1, 2], 0)
    state.observe(torch.tensor([1]), torch.tensor([2]))
    assert state.counts.sum() == 0  # observe is a no-op without penalised rows
    logits = torch.randn(1, VOCAB)
    assert state.penalize(logits, torch.tensor([1]), state.gather(torch.tensor([1]))) is logits
    state.start(2, SamplingParams(presence_penalty=1.0, seed=2), [3], 0)
    assert not state.gather(torch.tensor([1])).use_penalty  # exact per batch for CPU indices
    assert state.gather(torch.tensor([1, 2])).use_penalty


def test_restart_after_retraction_rebuilds_penalty_state():
    state = make_state()
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2, seed=9)
    prompt, outputs = [1, 2, 3], [4, 4, 2, 7]
    state.start(1, params, prompt, 0)
    for tok in outputs:
        state.observe(torch.tensor([1]), torch.tensor([tok]))
    counts, mask = state.counts[1].clone(), state.prompt_mask[1].clone()
    # Another request takes the row, then the retracted one resumes on a different row.
    state.start(1, SamplingParams(presence_penalty=1.0, seed=5), [5], 0)
    assert state.counts[1].sum() == 0 and state.prompt_mask[1].sum() == 1
    state.start(2, params, prompt + outputs, len(outputs))
    assert torch.equal(state.counts[2], counts)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[prompt + outputs] = True
    assert torch.equal(state.prompt_mask[2] | (state.counts[2] > 0), seen)
    assert torch.equal(mask | (counts > 0), seen)
    assert state.counts[2, 4].item() == 2


def uniform_noise(seeds, positions, stream: int, num: int) -> torch.Tensor:
    """[bs, num] uniforms of (seed, position, stream) for tokens 0 .. num - 1."""
    return uniform_from_keys(row_keys(seeds, positions, stream), column_hashes(torch.arange(num)))


def test_uniform_noise_range_invariance_and_streams():
    seeds = torch.tensor([0, 1, -5, 2**62])
    positions = torch.tensor([0, 100, 3, 2**31])
    u = uniform_noise(seeds, positions, STREAM_TOKEN, 4096)
    assert u.shape == (4, 4096) and u.dtype == torch.float32
    assert (u > 0).all() and (u < 1).all()
    assert abs(u.mean().item() - 0.5) < 0.01
    # Row values do not depend on the other rows or on num (beyond the prefix).
    alone = uniform_noise(seeds[2:3], positions[2:3], STREAM_TOKEN, 100)
    torch.testing.assert_close(alone[0], u[2, :100], rtol=0, atol=0)
    coins = uniform_noise(seeds, positions, STREAM_TOKEN + 1, 4096)
    assert (coins != u).float().mean() > 0.99
    # Neighbouring counters are not correlated.
    flat = u[0].double() - 0.5
    corr = (flat[1:] * flat[:-1]).mean() / flat.var()
    assert abs(corr.item()) < 4 / math.sqrt(flat.numel())
    # Rows (seeds, positions) are not correlated with each other.
    centred = u.double() - 0.5
    cross = (centred[0] * centred[1]).mean() / centred[0].var()
    assert abs(cross.item()) < 4 / math.sqrt(flat.numel())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    vocab = 4096
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02, seed=4),
        SamplingParams(temperature=1.2, frequency_penalty=0.4, repetition_penalty=1.1, seed=5),
    ]
    torch.manual_seed(4)
    logits = torch.randn(3, vocab) * 3
    results = []
    for device in ("cpu", "cuda"):
        state = SamplingState(4, vocab, device)
        for row, p in enumerate(params, start=1):
            state.start(row, p, [1, 2, 3, 2], 1)
        rows = torch.tensor([1, 2, 3])
        state.observe(rows.to(device), torch.tensor([7, 8, 7], device=device))
        tokens, logprobs = state.sample(logits.to(device), rows, torch.tensor([10, 11, 12]))
        results.append((tokens.cpu(), logprobs.cpu()))
        on_device, _ = state.sample(
            logits.to(device), rows.to(device), torch.tensor([10, 11, 12], device=device)
        )
        assert torch.equal(on_device.cpu(), tokens.cpu())
    assert torch.equal(results[0][0], results[1][0])
    torch.testing.assert_close(results[0][1], results[1][1], atol=1e-4, rtol=1e-4)


def test_observe_counts_only_each_rows_accepted_prefix():
    """An accepted speculative run: row i emitted the first lengths[i] of its tokens; the rest
    of its [S+1] slots (rejected drafts, padding) must not count for penalties."""
    from gpu_worker.sampling import SamplingState

    state = SamplingState(3, 10, "cpu")
    for row in (1, 2):
        state.start(row, SamplingParams(frequency_penalty=1.0, seed=row), [0], 0)
    tokens = torch.tensor([[4, 4, 5, 6], [7, 8, 9, 9]])
    state.observe(torch.tensor([1, 2]), tokens, lengths=torch.tensor([3, 1]))
    assert state.counts[1].tolist() == [0, 0, 0, 0, 2, 1, 0, 0, 0, 0]
    assert state.counts[2].tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]


@pytest.mark.parametrize("extra", ["none", "top_p", "top_k", "penalty", "min_p"])
def test_fixed_stages_give_each_row_its_own_token_and_logprob(extra):
    """The stage flags a captured decode graph runs with (`fixed_flags`: every stage on but
    the sort, which is on when a row asks for top-k / top-p) give exactly the tokens and
    logprobs of the per-batch flags, for greedy and sampled rows next to a row with `extra`."""
    state = make_state()
    params = {
        "none": SamplingParams(temperature=0.9, seed=4),
        "top_p": SamplingParams(temperature=0.9, top_p=0.8, seed=4),
        "top_k": SamplingParams(temperature=0.9, top_k=7, seed=4),
        "penalty": SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        "min_p": SamplingParams(temperature=1.1, min_p=0.05, seed=4),
    }[extra]
    state.start(1, SamplingParams(temperature=0.0), [1, 2], 0)
    state.start(2, SamplingParams(temperature=0.7, seed=9), [3], 0)
    state.start(3, params, [5, 6, 6], 1)
    sorts = extra in ("top_p", "top_k")
    torch.manual_seed(1)
    # with a sampled row; without one (the eager sampler then takes the argmax branch)
    for rows_cpu in (np.array([1, 2, 3, 2]), np.array([1, 3]), np.array([1])):
        beyond_argmax, sort = state.needs(rows_cpu)
        assert sort == (sorts and 3 in rows_cpu) and beyond_argmax == (len(rows_cpu) > 1)
        flags = fixed_flags(sort)
        for _ in range(5):
            logits = torch.randn(len(rows_cpu), VOCAB) * 2
            positions = torch.randint(0, 1000, (len(rows_cpu),))
            rows = torch.from_numpy(rows_cpu)
            exact = state.sample(logits, rows, positions, rows_cpu=rows_cpu)
            fixed = state.sample(logits, rows, positions, flags=flags)
            assert torch.equal(exact[0], fixed[0]) and torch.equal(exact[1], fixed[1])
