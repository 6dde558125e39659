"""The tensor-core projection of 2-16 rows against `F.linear` (CPU under Triton's interpreter,
and on CUDA in every model dtype), where `small_m_linear.linear` sends it, and the PDL row limit
that the model runners set from their weights."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from gpu_worker.kernels import few_row_linear, pdl
from gpu_worker.kernels import small_m_linear as sml
from gpu_worker.layers.linear import MergedLinear, Shard
from tests.gpu_worker.kernels.test_layer_kernels import CASES
from tests.gpu_worker.kernels.test_small_m_linear import random, tolerance

# (rows, K, N, block_k): one tile over K (a power of two, and not), a partial column block,
# the most rows, two and three tiles (the 135M down projection); K past them and a forced narrow
# block loop over K after the wait.
WIDEST = few_row_linear.TILE_BYTES // 4  # float32 columns per tile
SHAPES = [(2, 64, 48, None), (4, 40, 24, None), (5, 576, 100, None), (16, 200, 136, None),
          (3, 1536, 20, None), (6, 3 * WIDEST + 8, 40, None), (7, 200, 64, 32)]  # fmt: skip


@CASES
@pytest.mark.parametrize("rows, k, n, block_k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_row_linear_matches_the_library(device, dtype, rows, k, n, block_k, with_bias):
    gen = torch.Generator().manual_seed(rows * k + n)
    x = random(gen, device, dtype, rows, 2 * k)[:, :k]  # strided rows
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    b = random(gen, device, dtype, n) if with_bias else None
    out = few_row_linear.linear(x, w, b, block_k=block_k)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out, sml.linear_reference(x, w, b), **tolerance(dtype))


# (rows, K, N): one tile (the norm's width must fit one), then for SiLU-and-multiply two and
# three tiles and the loop past them.
PROLOGUE_SHAPES = [(2, 64, 48), (5, 500, 100), (16, 200, 136)]
SILU_SHAPES = PROLOGUE_SHAPES + [(3, 1536, 20), (6, 3 * WIDEST + 8, 40)]


@CASES
@pytest.mark.parametrize("rows, k, n", PROLOGUE_SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_the_norm_fused_before_the_projection(device, dtype, rows, k, n, with_residual):
    gen = torch.Generator().manual_seed(rows + k * n)
    x = random(gen, device, dtype, rows, 2 * k, scale=3.0)[:, :k]  # strided rows
    residual = random(gen, device, dtype, rows, k) if with_residual else None
    nw = random(gen, device, dtype, k)
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    b = random(gen, device, dtype, n)
    out, summed = few_row_linear.rms_norm_linear(x, residual, nw, 1e-5, w, b)
    ref_out, ref_summed = sml.rms_norm_linear_reference(x, residual, nw, 1e-5, w, b)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)  # the same rounding
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


@CASES
@pytest.mark.parametrize("rows, k, n", SILU_SHAPES)
def test_silu_and_mul_fused_before_the_projection(device, dtype, rows, k, n):
    gen = torch.Generator().manual_seed(k + n + rows)
    gate_up = random(gen, device, dtype, rows, 2 * k, scale=2.0)
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    out = few_row_linear.silu_mul_linear(gate_up, w)
    torch.testing.assert_close(out, sml.silu_mul_linear_reference(gate_up, w), **tolerance(dtype))


def test_a_norm_wider_than_one_tile_is_refused():
    k = few_row_linear.TILE_BYTES // 4 + 1  # float32: two tiles
    assert not few_row_linear.norm_fits(k, 4) and few_row_linear.norm_fits(k - 1, 4)
    with pytest.raises(AssertionError, match="one tile"):
        few_row_linear.rms_norm_linear(torch.zeros(2, k), None, torch.ones(k), 1e-5,
                                       torch.zeros(8, k))  # fmt: skip


def test_tiles_are_sized_by_bytes():
    assert few_row_linear.tiling(576, 2) == (1024, 1)  # the 135M qkv, gate_up: one bf16 tile
    assert few_row_linear.tiling(1536, 2) == (1024, 2)  # the 135M down: two
    assert few_row_linear.tiling(1536, 4) == (512, 3)  # float32: three narrower ones
    assert few_row_linear.tiling(4096, 2) == (1024, 0)  # wider: the loop
    assert few_row_linear.tiling(8, 2) == (16, 1)  # the MMA's least width


def test_the_kernel_takes_two_to_sixteen_rows():
    w = torch.zeros(16, 16)
    for rows in (1, few_row_linear.MAX_ROWS + 1):
        with pytest.raises(AssertionError, match="rows"):
            few_row_linear.linear(torch.zeros(rows, 16), w)


@pytest.mark.parametrize("rows, n, k, expected", [
    (4, 960, 576, True),  # the 135M qkv in a chain's verify
    (16, 576, 1536, True),  # the 135M down projection, 16 rows
    (1, 960, 576, False),  # one row: the fused kernel of small_m_linear
    (17, 960, 576, False),  # more rows: the library GEMM
    (4, 6144, 4096, False),  # a large weight (the 8B qkv): the library GEMM
])  # fmt: skip
def test_small_m_linear_sends_few_rows_of_small_weights_here(monkeypatch, rows, n, k, expected):
    monkeypatch.setattr(few_row_linear, "_launch", lambda p, *a, **kw: (f"kernel {p}", "sum"))
    monkeypatch.setattr(sml.F, "linear", lambda *a, **kw: "library")
    monkeypatch.setattr(sml, "_launch", lambda p, *a: (f"fused {p}", "sum"))
    monkeypatch.setattr(sml.norm, "add_rms_norm", lambda x, *a: (x, "sum"))
    monkeypatch.setattr(sml.activation, "silu_and_mul", lambda x: x[:, : x.shape[1] // 2])
    x, w = (torch.zeros(*shape, dtype=torch.bfloat16) for shape in ((rows, k), (n, k)))
    assert sml.few_rows(rows, n, k) is expected
    kind = "kernel" if expected else "fused" if rows == 1 else "library"

    def launched(prologue: int) -> str:  # fused into either kernel, or before the library GEMM
        return kind if kind == "library" else f"{kind} {prologue}"

    assert sml.linear(x, w) == launched(0)
    # a norm wider than one tile (1536 here) runs first, on its own
    norm_fused = kind != "kernel" or few_row_linear.norm_fits(k, x.element_size())
    assert sml.rms_norm_linear(x, x, x[0], 1e-5, w)[0] == launched(2 if norm_fused else 0)
    gate_up = torch.zeros(rows, 2 * k, dtype=torch.bfloat16)
    assert sml.silu_mul_linear(gate_up, w) == launched(3)
    monkeypatch.setattr(few_row_linear, "FUSE_PROLOGUE", False)  # the separate kernel first
    if expected:
        assert sml.rms_norm_linear(x, x, x[0], 1e-5, w)[0] == "kernel 0"
        assert sml.silu_mul_linear(gate_up, w) == "kernel 0"
    monkeypatch.setattr(sml, "FEW_ROW_KERNEL", False)
    assert not sml.few_rows(rows, n, k)


def layers(*shapes) -> nn.Module:
    """A module of MergedLinear projections of the given (in, out) widths, on the meta device."""
    with torch.device("meta"):
        return nn.ModuleList(MergedLinear(k, {"p": Shard(n, 0, n)}, False) for k, n in shapes)


def test_pdl_rows_follow_the_largest_projection_of_every_live_model(monkeypatch):
    monkeypatch.setattr(pdl, "_row_limits", type(pdl._row_limits)())
    monkeypatch.setattr(pdl, "MAX_ROWS", 1)
    small = layers((576, 960), (1536, 576))
    assert sml.pdl_rows(small) == few_row_linear.MAX_ROWS
    pdl.limit_rows(small, sml.pdl_rows(small))
    assert pdl.MAX_ROWS == few_row_linear.MAX_ROWS
    large = layers((576, 960), (4096, 6144))  # one weight past MAX_FUSED_WEIGHT
    assert sml.pdl_rows(large) == 1
    pdl.limit_rows(large, sml.pdl_rows(large))
    assert pdl.MAX_ROWS == 1  # the small model's runner cannot raise it
    pdl.limit_rows(small, sml.pdl_rows(small))
    assert pdl.MAX_ROWS == 1
    del large
    gc.collect()
    pdl.limit_rows(small, sml.pdl_rows(small))
    assert pdl.MAX_ROWS == few_row_linear.MAX_ROWS  # the large model is gone
    monkeypatch.setattr(sml, "FEW_ROW_KERNEL", False)
    assert sml.pdl_rows(small) == 1
