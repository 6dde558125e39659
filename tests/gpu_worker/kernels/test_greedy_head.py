"""The fused LM head + argmax against `torch.argmax` of the library head's logits (CPU under
Triton's interpreter in float32, and on CUDA in every model dtype): row blocks that do and do
not divide the rows, vocabularies and widths that do not divide the blocks, ties, and the
draft vocabulary's map."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.greedy_head import BLOCK_M, greedy_head, greedy_head_reference
from gpu_worker.sampling import (
    STREAM_TOKEN,
    DrawNoise,
    column_hashes,
    gumbel_from_keys,
    row_keys,
    sample_with_noise,
)
from tests.devices import triton_devices
from tests.gpu_worker.kernels.test_layer_kernels import CASES

# A logit within this of the row's largest may win: the kernel and the library GEMM may round
# a sum of products differently (float32: by the accumulation order only).
MARGIN = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


@CASES
@pytest.mark.parametrize(
    "rows, k, vocab", [(1, 40, 100), (4, 96, 300), (BLOCK_M + 3, 64, 1000), (3, 576, 8200)]
)
@pytest.mark.parametrize("mapped", [False, True])
def test_the_argmax_of_the_logits(device, dtype, rows, k, vocab, mapped):
    gen = torch.Generator().manual_seed(rows * vocab + k)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    weight = torch.randn(vocab, k, generator=gen) * k**-0.5
    # row 0's winner leads by far (random bf16 logits of a few rows may all be near-ties)
    weight[vocab // 3] = x[0].float().cpu() * 4 / x[0].float().norm().cpu()
    weight = weight.to(device, dtype)
    token_map = torch.randperm(vocab, generator=gen).to(device) * 3 + 7 if mapped else None
    ids = greedy_head(x, weight, token_map, num_sms=8)
    assert ids.shape == (rows,) and ids.dtype == torch.int64
    logits = torch.nn.functional.linear(x, weight).float()
    index = torch.arange(vocab, device=device)
    lookup = index if token_map is None else token_map
    inverse = {int(t): i for i, t in enumerate(lookup.tolist())}
    picked = torch.tensor([inverse[int(t)] for t in ids.tolist()], device=device)
    best = logits.max(dim=-1).values
    assert (logits.gather(1, picked[:, None])[:, 0] >= best - MARGIN[dtype]).all()
    # where the largest logit leads the next by more than the margin, the same token
    top2 = logits.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > MARGIN[dtype]
    expected = greedy_head_reference(x, weight, token_map)
    assert clear.any() and torch.equal(ids[clear], expected[clear])


@CASES
def test_ties_go_to_the_lowest_token_id(device, dtype):
    """Equal logits in different vocabulary blocks and within one: the first wins, as in
    `torch.argmax`."""
    x = torch.ones(2, 32, device=device, dtype=dtype)
    weight = torch.zeros(300, 32, device=device, dtype=dtype)
    weight[[170, 171, 290]] = 1.0
    weight[1, 0] = -1.0
    assert greedy_head(x, weight, num_sms=8).tolist() == [170, 170]
    weight[[40, 41]] = 1.0
    assert greedy_head(x, weight, num_sms=8).tolist() == [40, 40]
    assert greedy_head_reference(x, weight).tolist() == [40, 40]


def draw_noise(rows: int, columns: torch.Tensor, device, gen, noisy=None) -> DrawNoise:
    """Random temperatures and keys; every other row greedy unless `noisy` says."""
    keys = row_keys(torch.randint(0, 2**40, (rows,), generator=gen), torch.arange(rows) + 9, 0)
    noisy = torch.arange(rows) % 2 == 0 if noisy is None else noisy
    scale = 1 / (0.3 + torch.rand(rows, generator=gen))
    return DrawNoise(scale.to(device), keys.to(device), noisy.to(device), columns.to(device))


@CASES
@pytest.mark.parametrize("rows, k, vocab", [(3, 40, 300), (BLOCK_M + 2, 64, 1000)])
def test_noisy_rows_take_the_argmax_of_their_scaled_and_perturbed_logits(
    device, dtype, rows, k, vocab
):
    """A draft's coupled proposal: each noisy row's argmax of logits / T + the Gumbel noise of
    its key and each token's column hash (a mapped head's target ids), greedy rows' plain
    argmax, as `coupled_reference` computes them."""
    gen = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, k, generator=gen) * k**-0.5).to(device, dtype)
    token_map = torch.randperm(4 * vocab, generator=gen)[:vocab].to(device)
    noise = draw_noise(rows, column_hashes(token_map), device, gen)
    ids = greedy_head(x, weight, token_map, num_sms=8, noise=noise)
    logits = torch.nn.functional.linear(x, weight).float()
    scores = torch.where(
        noise.noisy[:, None],
        logits * noise.scale[:, None] + gumbel_from_keys(noise.keys, noise.columns),
        logits,
    )
    inverse = {int(t): i for i, t in enumerate(token_map.tolist())}
    picked = torch.tensor([inverse[int(t)] for t in ids.tolist()], device=device)
    best = scores.max(dim=-1).values
    margin = MARGIN[dtype] * noise.scale.max()
    assert (scores.gather(1, picked[:, None])[:, 0] >= best - margin).all()
    top2 = scores.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > margin
    expected = greedy_head_reference(x, weight, token_map, noise)
    assert clear.sum() >= rows // 2 and torch.equal(ids[clear], expected[clear])


@pytest.mark.parametrize("device", triton_devices())
def test_a_draft_that_agrees_with_the_target_proposes_the_targets_own_draw(device):
    """When the draft's logits over its vocabulary (a subset of the target's) equal the
    target's and the target's distribution lies inside it, the coupled proposal is exactly
    the token plain sampling draws for that seed and position: the draft then never misses."""
    gen = torch.Generator().manual_seed(3)
    rows, k, vocab = 6, 32, 400
    hot = torch.randperm(vocab, generator=gen)[:150].sort().values
    x = torch.randn(rows, k, generator=gen).to(device)
    weight = (torch.randn(150, k, generator=gen) * 2 * k**-0.5).to(device)
    seeds, positions = torch.arange(rows) * 7919 + 1, torch.arange(rows) + 100
    temperature = torch.tensor([0.5, 0.7, 1.0, 1.3, 0.8, 1.0])
    target = torch.full((rows, vocab), float("-inf"), device=device)
    target[:, hot.to(device)] = torch.nn.functional.linear(x, weight) / temperature[:, None].to(
        device
    )
    draws = sample_with_noise(target, seeds.to(device), positions.to(device))
    noise = DrawNoise(
        (1 / temperature).to(device),
        row_keys(seeds, positions, STREAM_TOKEN).to(device),
        torch.ones(rows, dtype=torch.bool, device=device),
        column_hashes(hot).to(device),
    )
    proposed = greedy_head(x, weight, hot.to(device), num_sms=8, noise=noise)
    assert torch.equal(proposed, draws)
    assert len(set(draws.tolist())) > 1  # not one token everywhere
