"""Projections of one to four rows, fused with the step before them: `linear`,
`rms_norm_linear` (add+RMSNorm first) and `silu_mul_linear` (SiLU-and-multiply first).

Each program computes a few output columns of a block of rows; the residual add before a norm
is computed by every program and stored by the first of each row block. Numerics are the
references': the input rounded to its dtype after the norm or gate, products summed in float32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.kernels import activation, batch_invariant, next_power_of_2, norm, pdl
from gpu_worker.kernels.activation import silu_and_mul_reference
from gpu_worker.kernels.norm import add_rms_norm_reference, rms_norm_reference
from gpu_worker.kernels.prologue import (
    ADD_NORM,
    NORM,
    PLAIN,
    SILU_MUL,
    input_tile,
    mean_square_rstd,
)

MAX_KERNEL_ROWS = 4  # stepping over K, the kernel holds [rows, block_n, block_k] products
MAX_ONE_TILE_ROWS = 16  # in one tile, a program per row block and column block


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    return F.linear(x, weight, bias)


def rms_norm_linear_reference(x, residual, norm_weight, eps, weight, bias=None):
    if residual is None:
        return F.linear(rms_norm_reference(x, norm_weight, eps), weight, bias), x
    normed, summed = add_rms_norm_reference(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear_reference(gate_up, weight, bias=None):
    return F.linear(silu_and_mul_reference(gate_up), weight, bias)


@triton.jit
def _row_dots(a, w):
    """[rows, K] . [cols, K] -> [rows, cols] in float32, on the CUDA cores: a few rows need no
    MMA."""
    return tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _small_m_linear_kernel(
    x_ptr,
    res_ptr,
    sum_ptr,
    norm_w_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    res_stride,
    out_stride,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ONE_TILE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (i, j) projects rows [j * BLOCK_M, (j + 1) * BLOCK_M) onto columns
    [i * BLOCK_N, (i + 1) * BLOCK_N). ONE_TILE (BLOCK_K covers K): it reads its weight tile
    before it waits for the kernel before it (`pdl`); the programs of the other row blocks read
    the same tile, from the L2 cache. Otherwise it waits first and steps over K."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if ONE_TILE:
        cols = tl.arange(0, BLOCK_K)
        w = tl.load(
            w_ptr + n[:, None] * K + cols[None, :],
            mask=n_ok[:, None] & (cols < K)[None, :],
            other=0.0,
        )
    pdl.wait_for_previous(USE_PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:  # a first pass: each row's mean square
        rstd = mean_square_rstd(
            x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps, PROLOGUE, BLOCK_M, BLOCK_K
        )
    if ONE_TILE:
        a = input_tile(
            x_ptr,
            res_ptr,
            sum_ptr,
            norm_w_ptr,
            rows,
            cols,
            row_ok[:, None] & (cols < K)[None, :],
            x_stride,
            res_stride,
            K,
            rstd,
            pid == 0,
            PROLOGUE,
        )
        acc = _row_dots(a, w)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_ok = cols < K
            a = input_tile(
                x_ptr,
                res_ptr,
                sum_ptr,
                norm_w_ptr,
                rows,
                cols,
                row_ok[:, None] & k_ok[None, :],
                x_stride,
                res_stride,
                K,
                rstd,
                pid == 0,
                PROLOGUE,
            )
            w = tl.load(
                w_ptr + n[:, None] * K + cols[None, :],
                mask=n_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            acc += _row_dots(a, w)
    acc += bias[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int
    block_m: int = 1  # rows per program where block_k covers K (else every row)


MAX_FUSED_WEIGHT = 4 << 20  # elements; 0 never fuses (bench_decode's "unfused" variants)
# One row of a larger weight: the kernel without the prologue (the norm or SiLU runs as its
# own kernel first), or the library GEMM where None (bench_decode's "library" variants).
# Two columns per program and 2048 keys per iteration: the best or within 1% of the best
# launch shape at every projection of the 8B shape (bench_small_m_linear.py on the H100).
GEMV_CONFIG: Config | None = Config(block_n=2, block_k=2048, num_warps=4)
# The widest input a small weight's program covers in one tile, so that it reads its weight
# before waiting for the kernel before it (`pdl`): every projection of the 135M shape.
ONE_TILE_K = 2048


def choose_config(rows: int, n: int, k: int, prologue: bool = False) -> Config | None:
    """The launch shape for rows x [n, k] (with the norm or SiLU step fused before it where
    `prologue`), or None where the caller runs something else: with `prologue`, the Triton
    norm or SiLU kernel and then `linear` (which asks again without the prologue); without,
    the library GEMM. From benchmarks/bench_small_m_linear.py (figures in
    docs/performance.md, "Projections of a few rows"):
    - up to pdl.MAX_ROWS rows of a small weight (every projection of the 135M shape): the
      fused kernel, one row per program at one row, two rows per program and eight columns
      at two to four (the fastest uniform launch shape over the 135M projections);
    - one row of a large weight (the 8B shape): the kernel alone reads the weight faster than
      the library GEMM, and a fused prologue, which every program repeats over the whole
      input row, costs more than the separate kernel it saves (GEMV_CONFIG);
    - more rows, or several of a large weight: the library GEMM is as fast or faster.
    A small weight's program covers its input in one tile up to ONE_TILE_K, which with PDL
    lets it read its weight while the kernel before it still runs."""
    if n * k <= MAX_FUSED_WEIGHT and rows <= pdl.MAX_ROWS:
        block_k = next_power_of_2(k) if k <= ONE_TILE_K else 512
        if rows > 1 and block_k >= k:
            return Config(block_n=8, block_k=block_k, num_warps=4, block_m=2)
        return Config(block_n=4 if n <= 1024 else 8, block_k=block_k, num_warps=4)
    if rows != 1 or n * k <= MAX_FUSED_WEIGHT:
        return None
    return None if prologue else GEMV_CONFIG


# Triton's interpreter (CPU) runs a launch's programs one after another in Python, each
# repeating the prologue over the whole input row: there a default launch of a small weight
# takes columns in blocks this wide, a few programs per projection. Explicit configs (kernel
# tests) and the large weights' GEMV_CONFIG are kept.
INTERPRETER_BLOCK_N = 256


def default_config(x: torch.Tensor, n: int, k: int, prologue: bool = False) -> Config | None:
    """`choose_config` for x's rows, with wide column blocks in the interpreter."""
    config = choose_config(x.shape[0], n, k, prologue)
    if config is None or config is GEMV_CONFIG or x.device.type != "cpu":
        return config
    return replace(
        config, block_n=max(config.block_n, min(INTERPRETER_BLOCK_N, next_power_of_2(n)))
    )


def _launch(prologue, x, weight, bias, residual, norm_weight, eps, config: Config):
    rows = x.shape[0]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    n, k = weight.shape
    one_tile = config.block_k >= k
    assert config.block_m in (1, 2, 4), f"block_m {config.block_m}: 1, 2 or 4 rows per program"
    limit = MAX_ONE_TILE_ROWS if one_tile else MAX_KERNEL_ROWS
    assert 0 < rows <= limit, f"{rows} rows: the fused kernel takes 1-{limit} at this width"
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else x
    res = residual if residual is not None else x
    block_m = config.block_m if one_tile else next_power_of_2(rows)
    _small_m_linear_kernel[(triton.cdiv(n, config.block_n), triton.cdiv(rows, block_m))](
        x,
        res,
        summed,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        rows,
        n,
        k,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        ONE_TILE=one_tile,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        num_warps=config.num_warps,
        **pdl.launch_args(x.device, rows),
    )
    return out, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None):
    """x [m, K] (rows may be strided) @ weight [N, K].T (+ bias) -> [m, N]. config: force the
    fused kernel with this launch shape (tests, benchmarks)."""
    if batch_invariant.ENABLED and config is None:
        return batch_invariant.linear(x, weight, bias)
    config = config or default_config(x, *weight.shape)
    if config is None:
        return F.linear(x, weight, bias)
    return _launch(PLAIN, x, weight, bias, None, None, 0.0, config)[0]


def _prologue_config(config: Config | None, x: torch.Tensor, n: int, k: int) -> Config | None:
    """The fused kernel's launch shape, or None for the separate norm or SiLU kernel and then
    `linear`: always None in the deterministic mode, whose fused prologue would be computed
    for every row of its 64-row tiles by every column block (`batch_invariant`)."""
    if config is None and batch_invariant.ENABLED:
        return None
    return config or default_config(x, n, k, prologue=True)


def rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None, config=None):
    """-> (rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: the norm of
    x alone, and x itself second."""
    config = _prologue_config(config, x, *weight.shape)
    if config is None:
        if residual is None:
            return linear(norm.rms_norm(x, norm_weight, eps), weight, bias), x
        normed, summed = norm.add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias), summed
    prologue = NORM if residual is None else ADD_NORM
    return _launch(prologue, x, weight, bias, residual, norm_weight, eps, config)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias=None, config=None):
    """gate_up [m, 2I] -> (silu(gate) * up) @ weight [H, I].T + bias -> [m, H]."""
    assert gate_up.shape[1] == 2 * weight.shape[1], "gate and up side by side: 2x the width"
    config = _prologue_config(config, gate_up, *weight.shape)
    if config is None:
        return linear(activation.silu_and_mul(gate_up), weight, bias)
    return _launch(SILU_MUL, gate_up, weight, bias, None, None, 0.0, config)[0]
