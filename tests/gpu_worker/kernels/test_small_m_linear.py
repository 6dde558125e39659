"""The fused few-row projections against the torch references (CPU under Triton's
interpreter, and on CUDA in every model dtype): plain, RMSNorm, residual add + RMSNorm,
SiLU-and-multiply; with and without bias; the kernel at 1 to 6 rows, in row blocks that do and
do not divide the rows, and launch shapes that do and do not divide the widths; and the
separate-kernel path the functions take where the fused kernel does not pay."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.kernels import pdl
from gpu_worker.kernels import small_m_linear as sml
from tests.gpu_worker.kernels.test_layer_kernels import CASES


def tolerance(dtype: torch.dtype) -> dict:
    # bfloat16: the kernel and the library GEMM may round a sum of products differently.
    return {
        torch.float32: {"atol": 1e-4, "rtol": 1e-4},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
        torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    }[dtype]


def random(gen, device, dtype, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)


# (rows, K, N, config): the chosen launch shape for one row of a narrow and of a wide
# projection and for three rows (two row blocks, the second partial); forced ones stepping over
# K at three and four rows, and in one tile at six (a program per row), five (a partial block
# of two rows) and three (partial blocks of rows and of columns); None for the separate
# kernels (16 rows).
SHAPES = [
    (1, 40, 24, "chosen"),
    (1, 520, 1040, "chosen"),
    (3, 520, 1040, "chosen"),
    (4, 520, 1040, sml.Config(8, 512, 4)),
    (3, 200, 136, sml.Config(4, 64, 2)),
    (6, 200, 136, sml.Config(4, 256, 4)),
    (5, 200, 136, sml.Config(4, 256, 4, block_m=2)),
    (3, 200, 138, sml.Config(8, 256, 4, block_m=2)),
    (16, 64, 48, None),
]


def config_for(rows, k, n, config):
    if config == "chosen":
        config = sml.choose_config(rows, n, k)
        assert config is not None
    return config


@CASES
@pytest.mark.parametrize("rows, k, n, config", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(device, dtype, rows, k, n, config, with_bias):
    gen = torch.Generator().manual_seed(rows * k + n)
    x = random(gen, device, dtype, rows, 2 * k)[:, :k]  # strided rows
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    b = random(gen, device, dtype, n) if with_bias else None
    out = sml.linear(x, w, b, config=config_for(rows, k, n, config))
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out, sml.linear_reference(x, w, b), **tolerance(dtype))


@CASES
@pytest.mark.parametrize("rows, k, n, config", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_linear(device, dtype, rows, k, n, config, with_residual):
    gen = torch.Generator().manual_seed(rows + k * n)
    x = random(gen, device, dtype, rows, k, scale=3.0)
    residual = random(gen, device, dtype, rows, k) if with_residual else None
    nw = random(gen, device, dtype, k)
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    b = random(gen, device, dtype, n)
    out, summed = sml.rms_norm_linear(
        x, residual, nw, 1e-5, w, b, config=config_for(rows, k, n, config)
    )
    ref_out, ref_summed = sml.rms_norm_linear_reference(x, residual, nw, 1e-5, w, b)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)  # the same rounding
    torch.testing.assert_close(out, ref_out, **tolerance(dtype))


@CASES
@pytest.mark.parametrize("rows, k, n, config", SHAPES)
def test_silu_mul_linear(device, dtype, rows, k, n, config):
    gen = torch.Generator().manual_seed(k + n + rows)
    gate_up = random(gen, device, dtype, rows, 2 * k, scale=2.0)
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    out = sml.silu_mul_linear(gate_up, w, config=config_for(rows, k, n, config))
    torch.testing.assert_close(out, sml.silu_mul_linear_reference(gate_up, w), **tolerance(dtype))


def test_the_fused_kernel_runs_only_where_it_pays():
    assert sml.choose_config(1, 3072, 576, prologue=True) is not None  # 135M gate_up, batch 1
    # one tile covers a small weight's input (its weight read before the PDL wait), up to
    # ONE_TILE_K; wider inputs loop over 512-wide tiles
    assert sml.choose_config(1, 576, 1536, prologue=True).block_k == 2048  # 135M down
    assert sml.choose_config(1, 960, 576, prologue=True).block_k == 1024  # 135M qkv
    assert sml.choose_config(1, 64, sml.ONE_TILE_K + 1).block_k < sml.ONE_TILE_K + 1
    # up to pdl.MAX_ROWS rows of a small weight (a chain S=3's verify): fused, two rows per
    # program from two rows on; more, the library
    assert pdl.MAX_ROWS >= 4
    assert sml.choose_config(1, 960, 576, prologue=True).block_m == 1
    assert sml.choose_config(pdl.MAX_ROWS, 960, 576, prologue=True).block_m == 2
    assert sml.choose_config(pdl.MAX_ROWS + 1, 960, 576) is None
    assert sml.choose_config(2, 6144, 4096) is None  # several rows of a large weight: the library
    # the 8B shape's qkv: bandwidth-bound; the kernel alone, after a separate norm
    assert sml.choose_config(1, 6144, 4096) == sml.GEMV_CONFIG is not None
    assert sml.choose_config(1, 6144, 4096, prologue=True) is None
    with pytest.raises(AssertionError, match="rows"):  # stepping over K
        sml.linear(
            torch.zeros(sml.MAX_KERNEL_ROWS + 1, 80),
            torch.zeros(4, 80),
            config=sml.Config(4, 64, 2),
        )
    with pytest.raises(AssertionError, match="block_m"):  # rows per program: a power of two
        sml.linear(torch.zeros(3, 8), torch.zeros(4, 8), config=sml.Config(4, 64, 2, block_m=3))
    with pytest.raises(AssertionError, match="rows"):  # one tile, row by row
        sml.linear(
            torch.zeros(sml.MAX_ONE_TILE_ROWS + 1, 8),
            torch.zeros(4, 8),
            config=sml.Config(4, 64, 2),
        )


@CASES
@pytest.mark.parametrize("gemv", [sml.GEMV_CONFIG, sml.Config(4, 64, 2), None])
def test_a_large_weight_runs_the_separate_step_then_the_gemv(monkeypatch, device, dtype, gemv):
    """Above MAX_FUSED_WEIGHT one row runs the norm or SiLU kernel, then the kernel without a
    prologue at GEMV_CONFIG (the library GEMM where that is None)."""
    monkeypatch.setattr(sml, "MAX_FUSED_WEIGHT", 0)  # every weight counts as large
    monkeypatch.setattr(sml, "GEMV_CONFIG", gemv)
    launches = []
    launch = sml._launch
    monkeypatch.setattr(sml, "_launch", lambda p, *a: launches.append((p, a[-1])) or launch(p, *a))
    gen = torch.Generator().manual_seed(3)
    k, n = 2100, 7  # a partial key block after a whole one at GEMV_CONFIG, a partial column
    x, residual, nw = (random(gen, device, dtype, 1, k) for _ in range(3))
    w = random(gen, device, dtype, n, k, scale=k**-0.5)
    out, summed = sml.rms_norm_linear(x, residual, nw[0], 1e-5, w)
    ref, ref_summed = sml.rms_norm_linear_reference(x, residual, nw[0], 1e-5, w)
    torch.testing.assert_close(out, ref, **tolerance(dtype))
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    gate_up = random(gen, device, dtype, 1, 2 * k)
    want = sml.silu_mul_linear_reference(gate_up, w)
    torch.testing.assert_close(sml.silu_mul_linear(gate_up, w), want, **tolerance(dtype))
    assert launches == ([(sml.PLAIN, gemv)] * 2 if gemv else [])


def test_the_interpreter_takes_wide_column_blocks_by_default():
    """On CPU (Triton's interpreter) a small weight's default launch takes up to 256 columns a
    program, so the prologue runs a few times, not once per 4 or 8 columns; the rest of the
    launch shape, the large weights' GEMV shape and GPU launches are the chosen ones."""
    x = torch.zeros(2, 576)
    chosen = sml.choose_config(2, 960, 576, prologue=True)
    wide = sml.default_config(x, 960, 576, prologue=True)
    assert wide == sml.Config(256, chosen.block_k, chosen.num_warps, chosen.block_m)
    assert sml.default_config(x, 24, 576).block_n == 32  # no wider than the weight
    assert sml.default_config(x[:1], 6144, 4096) is sml.GEMV_CONFIG
    if torch.cuda.is_available():
        assert sml.default_config(x.cuda(), 960, 576, prologue=True) == chosen
