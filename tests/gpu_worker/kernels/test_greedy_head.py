"""The fused LM head + argmax against `torch.argmax` of the library head's logits (CPU under
Triton's interpreter in float32, and on CUDA in every model dtype): row blocks that do and do
not divide the rows, vocabularies and widths that do not divide the blocks, ties, and the
draft vocabulary's map."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.greedy_head import BLOCK_M, greedy_head, greedy_head_reference
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
