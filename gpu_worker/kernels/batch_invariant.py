"""Projections whose every row is computed the same way whatever else is in the batch: the
matmul of the deterministic mode (issue: a request's output must not depend on what runs beside
it, with or without speculation).

The library GEMM and the few-row kernels choose their tiles, split-K and fused prologues by the
number of rows, so a row's float32 sums run in another order at another batch size and bf16
rounds the difference into a different token now and then. Here one launch shape serves every
row count: [BLOCK_M, block_n(N)] output tiles, the reduction over K in BLOCK_K steps in
order, no split-K, the norm or SiLU before the projection fused into its input tiles as the
few-row kernels fuse it. A row's result then depends on its own values only, not on the row
count, on its position in the batch, or on its neighbours.

`ENABLED` is the process-wide switch (`enable`, at start-up, before any runner is built): the
projection entry points (`small_m_linear.linear`, `rms_norm_linear`, `silu_mul_linear`, the LM
head) route here while it is set.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.kernels.prologue import (
    ADD_NORM,
    NORM,
    PLAIN,
    SILU_MUL,
    input_tile,
    mean_square_rstd,
)

ENABLED = False
# Rows of every launch's tiles: the MMA shape a row's sums take must not change with the row
# count (fewer rows would select another instruction).
BLOCK_M = 64


class Config(NamedTuple):
    """A launch shape: columns and K per program step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def enable(on: bool = True) -> None:
    """Route every projection through this module (on) or back to the fast paths."""
    global ENABLED
    ENABLED = on


def config_for(n: int, k: int) -> Config:
    """The launch shape of a weight [n, k]. A function of the weight only, so that every
    launch with it sums a row the same way whatever the row count: narrow column blocks for
    narrow weights, so that a few rows (a decode step) still spread over many programs."""
    return Config(16 if n <= 2048 else 32 if n <= 8192 else 64, 64, 4, 3)


@triton.jit(do_not_specialize=["M"])  # one binary for every row count
def _invariant_linear_kernel(
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
    DOT_PRECISION: tl.constexpr,
):
    """Program (i, j): rows [j * BLOCK_M, ...) x columns [i * BLOCK_N, ...), K in order, the
    input tile through the prologue (`prologue.input_tile`: the norm after a first pass over
    the row block's mean squares; its sum stored by the programs of column block 0)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, col_ok = rows < M, cols < N
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if PROLOGUE == 1 or PROLOGUE == 2:  # NORM, ADD_NORM
        rstd = mean_square_rstd(
            x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps, PROLOGUE, BLOCK_M, BLOCK_K
        )
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = input_tile(
            x_ptr,
            res_ptr,
            sum_ptr,
            norm_w_ptr,
            rows,
            ks,
            row_ok[:, None] & k_ok[None, :],
            x_stride,
            res_stride,
            K,
            rstd,
            tl.program_id(0) == 0,
            PROLOGUE,
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


def _launch(prologue, x, weight, bias, residual=None, norm_weight=None, eps=0.0, config=None):
    """-> (out [m, N], x + residual where prologue is ADD_NORM, else x). config: the launch
    shape (benchmarks and tests; None: `config_for` the weight)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == (2 * k if prologue == SILU_MUL else k), f"{x.shape} @ {weight.shape}"
    assert residual is None or residual.shape == x.shape, "the residual is shaped like x"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    summed = torch.empty(m, k, dtype=x.dtype, device=x.device) if prologue == ADD_NORM else x
    if m == 0:
        return out, summed
    res = residual if residual is not None else x
    cfg = config or config_for(n, k)
    _invariant_linear_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, BLOCK_M))](
        x,
        res,
        summed,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x.stride(0),
        res.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x [m, K] (rows may be strided) @ weight [N, K].T (+ bias) -> [m, N], each row the same
    bits at any m. float32 multiplies in full precision (no TF32)."""
    return _launch(PLAIN, x, weight, bias)[0]


def rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    """-> (rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: the norm of
    x alone, and x itself second. Each row the same bits at any row count."""
    prologue = NORM if residual is None else ADD_NORM
    assert residual is None or residual.stride(-1) == 1
    return _launch(prologue, x, weight, bias, residual, norm_weight, eps)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias=None):
    """gate_up [m, 2I] -> (silu(gate) * up) @ weight [H, I].T + bias, each row the same bits at
    any row count."""
    assert gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(SILU_MUL, gate_up, weight, bias)[0]


def linear_any(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`linear` while the mode is on, else the library GEMM: for projections (the LM head)
    that have no fast path of their own. Leading dimensions are flattened."""
    if not ENABLED:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
