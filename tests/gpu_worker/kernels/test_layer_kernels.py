"""The fused layer kernels against their torch references (CPU under Triton's interpreter at
small sizes, and on CUDA in every model dtype). Outputs are poisoned first, inputs random."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels.activation import silu_and_mul, silu_and_mul_reference
from gpu_worker.kernels.norm import (
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from gpu_worker.kernels.rotary import rope_and_store_kv, rope_and_store_kv_reference
from gpu_worker.layers.rotary import RotaryEmbedding
from tests.devices import triton_devices


def devices_and_dtypes():
    cases = []
    for device in triton_devices():
        dtypes = (
            (torch.float32,) if device == "cpu" else (torch.float32, torch.bfloat16, torch.float16)
        )
        cases += [(device, dt) for dt in dtypes]
    return cases


CASES = pytest.mark.parametrize("device, dtype", devices_and_dtypes())


def tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
        torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    }[dtype]


@CASES
@pytest.mark.parametrize("hidden", [48, 64, 576])
def test_rms_norm_and_the_fused_residual_add(device, dtype, hidden):
    gen = torch.Generator().manual_seed(hidden)
    x = torch.randn(7, hidden, generator=gen).to(device, dtype)
    residual = torch.randn(7, hidden, generator=gen).to(device, dtype)
    weight = torch.randn(hidden, generator=gen).to(device, dtype)
    torch.testing.assert_close(
        rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), **tolerance(dtype)
    )
    out, summed = add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_summed = add_rms_norm_reference(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)  # the same rounding
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))
    strided = torch.randn(7, hidden * 2, generator=gen).to(device, dtype)[:, :hidden]
    torch.testing.assert_close(
        rms_norm(strided, weight, 1e-6),
        rms_norm_reference(strided, weight, 1e-6),
        **tolerance(dtype),
    )
    # into the second half of a wider buffer (the EAGLE-3 draft's cat): the first untouched
    wide = torch.full((7, 2 * hidden), -7.0, dtype=dtype, device=device)
    into = rms_norm(x, weight, 1e-6, out=wide[:, hidden:])
    assert into.data_ptr() == wide[:, hidden:].data_ptr()
    torch.testing.assert_close(
        wide[:, hidden:], rms_norm_reference(x, weight, 1e-6), **tolerance(dtype)
    )
    assert bool((wide[:, :hidden] == -7.0).all())


@CASES
@pytest.mark.parametrize("inter", [40, 1536])
def test_silu_and_mul(device, dtype, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(5, 2 * inter, generator=gen).to(device, dtype)
    torch.testing.assert_close(
        silu_and_mul(gate_up), silu_and_mul_reference(gate_up), **tolerance(dtype)
    )


@CASES
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, qk_norm",
    [
        (4, 2, 16, False),
        (9, 3, 64, False),
        (4, 4, 32, True),
        (6, 2, 24, False),
    ],
)
def test_rope_and_kv_store(device, dtype, heads, kv_heads, head_dim, qk_norm):
    gen = torch.Generator().manual_seed(heads * head_dim)
    n, num_slots = 6, 20
    rotary = RotaryEmbedding(
        head_dim,
        10000.0,
        {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16},
    )
    cache = rotary.build_cos_sin_cache(64, torch.device(device))
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    positions = torch.randint(0, 64, (n,), generator=gen).to(device)
    loc = torch.randperm(num_slots, generator=gen)[:n].to(device)
    norms = [torch.randn(head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    norms = norms if qk_norm else [None, None]
    pools = []
    for _ in range(2):  # kernel, reference: same poisoned pools
        k = torch.full((num_slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
        pools.append((k, k.clone()))
    q = rope_and_store_kv(qkv, positions, cache, *pools[0], loc, heads, kv_heads, *norms, 1e-6)
    ref = rope_and_store_kv_reference(
        qkv, positions, cache, *pools[1], loc, heads, kv_heads, *norms, 1e-6
    )
    torch.testing.assert_close(q, ref, **tolerance(dtype))
    for got, want in zip(pools[0], pools[1], strict=True):
        torch.testing.assert_close(got[loc], want[loc], **tolerance(dtype))
        untouched = torch.ones(num_slots, dtype=torch.bool, device=device)
        untouched[loc] = False
        assert got[untouched].isnan().all()  # nothing else written
