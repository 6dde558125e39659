"""torch_native against attention written out by hand (explicit softmax, repeated kv heads)."""

from __future__ import annotations

import dataclasses

import torch

from gpu_worker.attention import create_attention_backend
from gpu_worker.attention.torch_native import build_causal_mask
from gpu_worker.kv_cache import KVPool, ReqToTokenPool
from gpu_worker.step.forward_batch import ForwardMode, build_forward_batch

HEADS, KV_HEADS, D = 4, 2, 8


class Layer:
    layer_id, num_heads, num_kv_heads, head_dim, scaling = 1, HEADS, KV_HEADS, D, D**-0.5


def naive_attention(q, k, v, mask):
    """q [n, H, D], k/v [s, KV, D], mask [n, s] -> [n, H, D]."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("nhd,shd->hns", q, k) * D**-0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hns,shd->nhd", scores.softmax(-1), v)


def test_causal_mask_shape_and_rule():
    mask = build_causal_mask(committed_len=2, extend_len=3, device=torch.device("cpu"))
    assert mask.tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]


def test_paged_extend_over_prefix_matches_naive():
    torch.manual_seed(0)
    req_pool = ReqToTokenPool(2, 16, "cpu")
    kv_pool = KVPool(32, 1, 2, KV_HEADS, D, torch.float32, "cpu")
    backend = create_attention_backend("torch_native", req_pool, kv_pool, HEADS)
    prefix_k, prefix_v = torch.randn(5, KV_HEADS, D), torch.randn(5, KV_HEADS, D)
    prefix_slots = torch.tensor([9, 3, 27, 14, 6])
    kv_pool.set_kv(1, prefix_slots, prefix_k, prefix_v)
    new_slots = [20, 2, 31]
    req_pool.write(
        torch.tensor([2]),
        torch.tensor([0]),
        torch.cat([prefix_slots, torch.tensor(new_slots)]),
        torch.tensor([8]),
    )
    batch = build_forward_batch(ForwardMode.EXTEND, [[1, 2, 3]], [5], [new_slots], [2], "cpu")
    k, v = torch.randn(3, KV_HEADS, D), torch.randn(3, KV_HEADS, D)
    kv_pool.set_kv(1, torch.tensor(new_slots), k, v)  # the layer stores K/V before attending
    batch = dataclasses.replace(
        batch, attn_backend=backend, attn_metadata=backend.init_forward_metadata(batch)
    )
    q = torch.randn(3, HEADS * D)
    o = backend.forward(q, Layer(), batch)
    all_k, all_v = torch.cat([prefix_k, k]), torch.cat([prefix_v, v])
    mask = torch.ones(3, 8, dtype=torch.bool).tril(diagonal=5)
    expected = naive_attention(q.view(3, HEADS, D), all_k, all_v, mask).reshape(3, HEADS * D)
    torch.testing.assert_close(o, expected, atol=1e-5, rtol=0)


def test_unknown_backend_lists_available():
    try:
        create_attention_backend(
            "flash", ReqToTokenPool(1, 4, "cpu"), KVPool(4, 1, 1, 1, 2, torch.float32, "cpu"), 1
        )
    except ValueError as e:
        assert "torch_native" in str(e)
    else:
        raise AssertionError("unknown backend accepted")
