"""The step fused before a projection, as the projection kernels read their input: the
RMSNorm (of x, or of x + residual) or SiLU-and-multiply, tile by tile. Numerics are the
separate kernels' references: the input rounded to its dtype after the sum, the norm and the
gate. Read by the few-row kernels (`small_m_linear`).
"""

from __future__ import annotations

import triton
import triton.language as tl

# What comes before the projection: the kernels' PROLOGUE constexpr, which they compare with
# these numbers as literals (a jitted function reads no plain module global).
PLAIN, NORM, ADD_NORM, SILU_MUL = 0, 1, 2, 3


@triton.jit
def input_tile(
    x_ptr,
    res_ptr,
    sum_ptr,
    norm_w_ptr,
    rows,
    cols,
    mask,
    x_stride,
    res_stride,
    inter,
    rstd,
    store_sum,
    PROLOGUE: tl.constexpr,
):
    """The [rows, cols] tile of the projection's input, in the input dtype."""
    x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
    if PROLOGUE == 3:  # silu(gate) * up, gate and up side by side in x
        up = tl.load(x_ptr + rows[:, None] * x_stride + inter + cols[None, :], mask=mask, other=0.0)
        gate = x.to(tl.float32)
        return (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(x.dtype)
    if PROLOGUE == 2:
        r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like x + residual
        if store_sum:
            tl.store(sum_ptr + rows[:, None] * inter + cols[None, :], x, mask=mask)
    if PROLOGUE >= 1:  # NORM or ADD_NORM (SILU_MUL returned)
        w = tl.load(norm_w_ptr + cols, mask=cols < inter, other=0.0)
        normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
        x = (normed.to(tl.float32) * w.to(tl.float32)[None, :]).to(x.dtype)
    return x


@triton.jit
def mean_square_rstd(
    x_ptr,
    res_ptr,
    rows,
    row_ok,
    x_stride,
    res_stride,
    K,
    eps,
    PROLOGUE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """1 / rms of each row of the norm's input (x, or x + residual rounded like the sum)."""
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=mask, other=0.0)
        if PROLOGUE == 2:
            r = tl.load(res_ptr + rows[:, None] * res_stride + cols[None, :], mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
    return tl.rsqrt(squares / K + eps)
