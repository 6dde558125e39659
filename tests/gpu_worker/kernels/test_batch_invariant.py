"""The deterministic mode's projections: a row's result is the same bits alone, inside batches
of other sizes, at another position, and beside other rows (CPU under Triton's interpreter, and
on CUDA in every model dtype); and close to the library GEMM. With the mode on, the few-row
entry points (which otherwise pick fused kernels by row count) give a row the same bits at one
row as inside a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_worker.kernels import batch_invariant
from gpu_worker.kernels import small_m_linear as sml
from tests.devices import skip_unless_triton_runs_on, triton_devices
from tests.gpu_worker.kernels.test_layer_kernels import CASES
from tests.gpu_worker.kernels.test_small_m_linear import random, tolerance


@pytest.fixture
def invariant_mode():
    batch_invariant.enable()
    yield
    batch_invariant.enable(False)


def each_row_alone_and_in_batches(fn, x: torch.Tensor) -> None:
    """fn(rows) for every row alone, for the whole batch, for a slice that moves the rows to
    other positions in their tiles, and for the batch reversed: every row bit-equal."""
    whole = fn(x)
    rows = x.shape[0]
    for i in range(rows):
        assert torch.equal(fn(x[i : i + 1]), whole[i : i + 1]), f"row {i} alone"
    assert torch.equal(fn(x[3:]), whole[3:]), "rows shifted by 3"
    assert torch.equal(fn(x.flip(0)), whole.flip(0)), "rows reversed"


@CASES
@pytest.mark.parametrize("bias", [False, True])
def test_a_row_is_the_same_at_every_batch_size(device: str, dtype: torch.dtype, bias: bool):
    gen = torch.Generator().manual_seed(0)
    # 70 rows: two row tiles, the second partial; K and N not multiples of the tiles
    x = random(gen, device, dtype, 70, 200)
    w = random(gen, device, dtype, 136, 200, scale=200**-0.5)
    b = random(gen, device, dtype, 136) if bias else None
    each_row_alone_and_in_batches(lambda rows: batch_invariant.linear(rows, w, b), x)
    expected = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(
        batch_invariant.linear(x, w, b).float(), expected, **tolerance(dtype)
    )


@pytest.mark.parametrize("device", triton_devices())
@pytest.mark.parametrize(
    "config",
    [
        batch_invariant.Config(32, 64, 4, 3),
        batch_invariant.Config(64, 64, 4, 3),
        batch_invariant.Config(16, 32, 4, 2),
        batch_invariant.Config(32, 128, 8, 4),
        batch_invariant.Config(16, 512, 2, 2, block_m=16),  # the warp MMA, long K steps
    ],
    ids=str,
)
def test_every_launch_shape_gives_a_row_the_same_bits(device, config, monkeypatch):
    """Each weight has its own launch shape (`config_for`): columns, K step, warps, stages
    (and rows per tile, which benchmarks vary)."""
    skip_unless_triton_runs_on(device)
    monkeypatch.setattr(batch_invariant, "config_for", lambda n, k, size: config)
    gen = torch.Generator().manual_seed(2)
    x = random(gen, device, torch.float32, 70, 80)
    w = random(gen, device, torch.float32, 100, 80, scale=80**-0.5)
    each_row_alone_and_in_batches(lambda rows: batch_invariant.linear(rows, w), x)
    torch.testing.assert_close(
        batch_invariant.linear(x, w), F.linear(x, w), **tolerance(torch.float32)
    )


@pytest.mark.parametrize("device", triton_devices())
def test_the_mode_routes_every_entry_point(device: str, invariant_mode) -> None:
    """Off, these pick other kernels at 1-4 rows than at 70 (and differ in the last bits)."""
    skip_unless_triton_runs_on(device)
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float32
    x = random(gen, device, dtype, 70, 96)
    residual = random(gen, device, dtype, 70, 96)
    norm_w = random(gen, device, dtype, 96)
    w = random(gen, device, dtype, 48, 96, scale=96**-0.5)
    gate_up = random(gen, device, dtype, 70, 2 * 96)
    each_row_alone_and_in_batches(lambda rows: sml.linear(rows, w), x)
    each_row_alone_and_in_batches(
        lambda rows: sml.rms_norm_linear(rows, None, norm_w, 1e-6, w)[0], x
    )
    both = torch.cat([x, residual], dim=1)
    add_norm = lambda rows: sml.rms_norm_linear(rows[:, :96], rows[:, 96:], norm_w, 1e-6, w)[0]  # noqa: E731
    each_row_alone_and_in_batches(add_norm, both)
    each_row_alone_and_in_batches(lambda rows: sml.silu_mul_linear(rows, w), gate_up)
    out, summed = sml.rms_norm_linear(x, residual, norm_w, 1e-6, w)
    expected, expected_sum = sml.rms_norm_linear_reference(x, residual, norm_w, 1e-6, w)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    assert torch.equal(summed, expected_sum)  # rounded like the separate add
    torch.testing.assert_close(
        sml.rms_norm_linear(x, None, norm_w, 1e-6, w)[0],
        sml.rms_norm_linear_reference(x, None, norm_w, 1e-6, w)[0],
        **tolerance(dtype),
    )
    torch.testing.assert_close(
        sml.silu_mul_linear(gate_up, w),
        sml.silu_mul_linear_reference(gate_up, w),
        **tolerance(dtype),
    )
    # off, the entry points pick their kernels by row count again and a row differs
    batch_invariant.enable(False)
    with pytest.raises(AssertionError, match="alone"):
        each_row_alone_and_in_batches(add_norm, both)


def test_a_mismatched_width_is_refused_before_any_launch():
    """The kernel reads K from the weight: a narrower x would be read past its rows."""
    x, w = torch.zeros(3, 40), torch.zeros(16, 48)
    with pytest.raises(AssertionError, match=r"\(3, 40\) @ \(16, 48\)"):
        batch_invariant.linear(x, w)
    with pytest.raises(AssertionError, match="2x the width"):
        sml.silu_mul_linear(torch.zeros(3, 48), w)


@pytest.mark.parametrize("element_size", [2, 4])
def test_every_launch_shape_fits_an_sms_shared_memory(element_size):
    """Each weight's pipeline stages (a 64-row input tile and a weight tile each) fit the
    shared memory budget, in bf16 and in float32, from the 135M shape's to an 8B LM head."""
    for n in (8, 576, 960, 3072, 4096, 6144, 28672, 49152, 128256):
        for k in (16, 576, 1536, 4096, 14336):
            cfg = batch_invariant.config_for(n, k, element_size)
            tile = (batch_invariant.BLOCK_M + cfg.block_n) * cfg.block_k * element_size
            assert cfg.num_stages >= 2 and cfg.block_k >= 16, (n, k, cfg)
            assert cfg.num_stages * tile <= batch_invariant.SHARED_MEMORY, (n, k, cfg)
