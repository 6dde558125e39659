"""Projections whose every row is computed the same way whatever else is in the batch: the
matmul of the deterministic mode (issue: a request's output must not depend on what runs beside
it, with or without speculation).

The library GEMM and the few-row kernels choose their tiles, split-K and fused prologues by the
number of rows, so a row's float32 sums run in another order at another batch size and bf16
rounds the difference into a different token now and then. Here one launch shape serves every
row count: fixed [BLOCK_M, BLOCK_N] output tiles, the reduction over K in BLOCK_K steps in
order, no split-K. A row's result then depends on its own values only, not on the row count,
on its position in the batch, or on its neighbours.

`ENABLED` is the process-wide switch (`enable`, at start-up, before any runner is built): the
projection entry points (`small_m_linear.linear`, `rms_norm_linear`, `silu_mul_linear`, the LM
head) route here while it is set, with the norm and SiLU steps as kernels of their own (one
program per row, so invariant as they are).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

ENABLED = False
# One launch shape for every row count; the MMA tiles are what must not change.
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


def enable(on: bool = True) -> None:
    """Route every projection through `linear` (on) or back to the fast paths."""
    global ENABLED
    ENABLED = on


@triton.jit(do_not_specialize=["M"])  # one binary for every row count
def _invariant_linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    x_stride,
    out_stride,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (i, j): rows [j * BLOCK_M, ...) x columns [i * BLOCK_N, ...), K in order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * x_stride + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
            mask=col_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(
        out_ptr + rows[:, None] * out_stride + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & col_ok[None, :],
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [m, K] (rows may be strided) @ weight [N, K].T (+ bias) -> [m, N], each row the same
    bits at any m. float32 multiplies in full precision (no TF32)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(m, BLOCK_M))
    _invariant_linear_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def linear_any(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`linear` while the mode is on, else the library GEMM: for projections (the LM head)
    that have no fast path of their own. Leading dimensions are flattened."""
    if not ENABLED:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
