"""Projections of a single row (batch-1 decode), fused with the step before them.

    linear(x, w, b)                          -> x @ w.T + b
    rms_norm_linear(x, residual, nw, eps, w) -> (rms_norm(x + residual) @ w.T, x + residual)
    silu_mul_linear(gate_up, w, b)           -> silu_and_mul(gate_up) @ w.T + b

At batch 1 a projection reads its whole weight to produce one row: the work is the weight's
bytes, and a library GEMM call costs a launch and a tail each time (3-5 us at the SmolLM2-135M
shapes, where the weight itself takes under 1 us to read). The kernel gives each program a few
output columns, computes their dot products on the CUDA cores, and does the step before the
projection in its prologue, so a decoder layer runs five kernels: norm+qkv, attention, o_proj,
norm+gate_up, silu+down. The residual add before a norm is computed by every program (its input
is a few KB) and stored by the first. Where the fused prologue does not pay (`choose_config`):
one row of a large weight (the 8B shape's) runs the separate norm or SiLU kernel, then this
kernel without a prologue, which reads the weight closer to the memory bandwidth than the
library GEMM does; several rows run the separate kernels and the library GEMM.

Numerics are the references' (`norm.add_rms_norm_reference`, `activation.silu_and_mul_reference`
followed by `F.linear`): the normalised or gated input is rounded to the input dtype before the
product, which accumulates in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.kernels import activation, next_power_of_2, norm, pdl
from gpu_worker.kernels.activation import silu_and_mul_reference
from gpu_worker.kernels.norm import add_rms_norm_reference, rms_norm_reference

MAX_KERNEL_ROWS = 4  # the kernel holds [rows, block_n, block_k] products in registers

_PLAIN, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3


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
def _input_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, cols, mask, x_stride, res_stride,
                inter, rstd, store_sum, PROLOGUE: tl.constexpr):  # fmt: skip
    """The [rows, cols] tile of the projection's input, in the input dtype."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if PROLOGUE == 3:  # silu(gate) * up, gate and up side by side in x
        up = tl.load(x_ptr + rows[:, None] * x_stride + inter + cols[None, :], mask=mask,
                     other=0.0)  # fmt: skip
        gate = x.to(tl.float32)
        return (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(x.dtype)
    if PROLOGUE == 2:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like x + residual
        if store_sum:
            tl.store(sum_ptr + rows[:, None] * inter + cols[None, :], x, mask=mask)
    if PROLOGUE >= 1:
        w = tl.load(norm_w_ptr + cols, mask=cols < inter, other=0.0)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(x.dtype)
    return x


@triton.jit
def _mean_square_rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps,
                      PROLOGUE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):  # fmt: skip
    """1 / rms of each row of the norm's input (x, or x + residual rounded like the sum)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        if PROLOGUE == 2:
            r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask,
                        other=0.0)  # fmt: skip
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(squares / K + eps)


@triton.jit
def _small_m_linear_kernel(
    x_ptr, res_ptr, sum_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, x_stride, res_stride, out_stride, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """With USE_PDL (`pdl`): where one tile covers K, the program reads its weight tile (and
    bias) before it waits for the kernel before it; otherwise it waits first."""
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_K >= K:  # one tile: the weight first, then the input once it is written
        cols = tl.arange(0, BLOCK_K)
        k_ok = cols < K
        w = tl.load(w_ptr + n[:, None] * K + cols[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K], contiguous along K  # fmt: skip
        pdl.wait_for_previous(USE_PDL)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:
            rstd = _mean_square_rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps,
                                     PROLOGUE, BLOCK_M, BLOCK_K)  # fmt: skip
        a = _input_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, cols,
                        row_ok[:, None] & k_ok[None, :], x_stride, res_stride, K, rstd,
                        pid == 0, PROLOGUE)  # fmt: skip
        acc += tl.sum(a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        pdl.wait_for_previous(USE_PDL)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:  # first pass: each row's mean square
            rstd = _mean_square_rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps,
                                     PROLOGUE, BLOCK_M, BLOCK_K)  # fmt: skip
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            k_ok = cols < K
            a = _input_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, cols,
                            row_ok[:, None] & k_ok[None, :], x_stride, res_stride, K, rstd,
                            pid == 0, PROLOGUE)  # fmt: skip
            w = tl.load(w_ptr + n[:, None] * K + cols[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            products = a.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
            acc += tl.sum(products, axis=2)  # on the CUDA cores: a row or two needs no MMA
    acc += bias[None, :]
    out_mask = row_ok[:, None] & n_ok[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    num_warps: int


MAX_FUSED_WEIGHT = 4 << 20  # elements; 0 never fuses (bench_decode's "unfused" variants)
# Rows (tokens) up to which a small weight runs the fused kernel. One: at two to four rows (a
# chain's verify, the draft extend) the kernel on the CUDA cores costs more than the separate
# norm or SiLU kernel and the library GEMM together (see choose_config); bench_speculative.py
# --fused-rows measures a speculative iteration at other limits.
MAX_FUSED_ROWS = 1
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
    the library GEMM. From benchmarks/bench_small_m_linear.py on the H100 (bf16, per
    call inside a CUDA graph, weights read from memory as in a step):
    - one row, a small weight (every projection of the 135M shape): the fused kernel takes
      2.5-3.8 us where norm + GEMM takes 4.7-6.2 us;
    - one row, a large weight (the 8B shape: 13-85 us of bandwidth): the kernel alone reads
      the weight at 2.5-3.1 TB/s where the library GEMM reaches 2.0-2.8 (its split-K tiles
      for the down projection leave bandwidth unused), and a fused prologue, which every
      program repeats over the whole input row, costs more than the separate kernel it saves
      (GEMV_CONFIG, after that kernel);
    - two to four rows of a small weight (a chain's verify of 4 tokens, the draft extend):
      the fused kernel takes 5.6-8.6 us at four rows against 5.4-6.6 us for the separate
      kernel and the library GEMM, and a chain S=3 iteration on the 135M shape took 1.35 ms
      of GPU time with it against 1.21 ms without (MAX_FUSED_ROWS 4 against 1). A variant
      on the tensor cores (rows padded to a 16-row tile) matched the library GEMM alone, but
      with the prologue took 7.4-22 us, so several rows run the separate kernels;
    - more rows, or several of a large weight: the library GEMM is as fast or faster.
    A small weight's program covers its input in one tile up to ONE_TILE_K, which with PDL
    lets it read its weight while the kernel before it still runs."""
    if n * k <= MAX_FUSED_WEIGHT and rows <= MAX_FUSED_ROWS:
        block_k = next_power_of_2(k) if k <= ONE_TILE_K else 512
        return Config(block_n=4 if n <= 1024 else 8, block_k=block_k, num_warps=4)
    if rows != 1 or n * k <= MAX_FUSED_WEIGHT:
        return None
    return None if prologue else GEMV_CONFIG


def _launch(prologue, x, weight, bias, residual, norm_weight, eps, config: Config):
    rows = x.shape[0]
    assert 0 < rows <= MAX_KERNEL_ROWS, f"{rows} rows: the fused kernel takes 1-{MAX_KERNEL_ROWS}"
    assert x.stride(-1) == 1 and weight.is_contiguous()
    n, k = weight.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows, k, dtype=x.dtype, device=x.device) if prologue == _ADD_NORM else x
    res = residual if residual is not None else x
    _small_m_linear_kernel[(triton.cdiv(n, config.block_n),)](
        x, res, summed, norm_weight if norm_weight is not None else weight,
        weight, bias if bias is not None else weight, out,
        rows, n, k, x.stride(0), res.stride(0), out.stride(0), eps,
        PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=next_power_of_2(rows),
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, num_warps=config.num_warps,
        **pdl.launch_args(x.device, rows),
    )  # fmt: skip
    return out, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config=None):
    """x [m, K] (rows may be strided) @ weight [N, K].T (+ bias) -> [m, N]. config: force the
    fused kernel with this launch shape (tests, benchmarks)."""
    config = config or choose_config(x.shape[0], *weight.shape)
    if config is None:
        return F.linear(x, weight, bias)
    return _launch(_PLAIN, x, weight, bias, None, None, 0.0, config)[0]


def rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None, config=None):
    """-> (rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: the norm of
    x alone, and x itself second."""
    config = config or choose_config(x.shape[0], *weight.shape, prologue=True)
    if config is None:
        if residual is None:
            return linear(norm.rms_norm(x, norm_weight, eps), weight, bias), x
        normed, summed = norm.add_rms_norm(x, residual, norm_weight, eps)
        return linear(normed, weight, bias), summed
    prologue = _NORM if residual is None else _ADD_NORM
    return _launch(prologue, x, weight, bias, residual, norm_weight, eps, config)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias=None, config=None):
    """gate_up [m, 2I] -> (silu(gate) * up) @ weight [H, I].T + bias -> [m, H]."""
    assert gate_up.shape[1] == 2 * weight.shape[1]
    config = config or choose_config(gate_up.shape[0], *weight.shape, prologue=True)
    if config is None:
        return linear(activation.silu_and_mul(gate_up), weight, bias)
    return _launch(_SILU_MUL, gate_up, weight, bias, None, None, 0.0, config)[0]
