"""Projections whose every row is computed the same way whatever else is in the batch: the
matmul of the deterministic mode (issue: a request's output must not depend on what runs beside
it, with or without speculation).

The library GEMM and the few-row kernels choose their tiles, split-K and fused prologues by the
number of rows, so a row's float32 sums run in another order at another batch size and bf16
rounds the difference into a different token now and then. Here one launch shape per weight
serves every row count: [BLOCK_M, block_n] output tiles, the reduction over K in block_k steps
in order, no split-K. A row's result then depends on its own values only, not on the row count,
on its position in the batch, or on its neighbours.

`ENABLED` is the process-wide switch (`enable`, at start-up, before any runner is built): the
projection entry points (`small_m_linear.linear`, `rms_norm_linear`, `silu_mul_linear`, the LM
head) route their matmul here while it is set. The norm or SiLU before a projection then runs
as the entry points' separate kernel (`norm`, `activation`: one program per row or per
element, launched alike at every row count), not fused into the input tiles: a fused prologue
would be computed on all BLOCK_M rows of a tile by each of the weight's column blocks, which at
a decode step's few rows costs several times the projection itself.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.kernels import pdl

ENABLED = False
# Rows of every launch's tiles: the MMA shape a row's sums take must not change with the row
# count (fewer rows would select another instruction on SM 9.0: 64 rows take the warpgroup
# MMA, 16 the warp MMA).
BLOCK_M = 64
SHARED_MEMORY = 200 * 1024  # of the 227 KiB an SM 9.0 program may take, the stages' share


class Config(NamedTuple):
    """A launch shape: columns and K per program step, warps, pipeline stages, rows per tile
    (other than BLOCK_M only in benchmarks, which check whether it keeps a row's bits)."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_m: int = BLOCK_M


def enable(on: bool = True) -> None:
    """Route every projection through this module (on) or back to the fast paths."""
    global ENABLED
    ENABLED = on


@functools.cache  # asked at every eager launch
def config_for(n: int, k: int, element_size: int = 2) -> Config:
    """The launch shape of a weight [n, k] of this element size: a function of the weight
    only, so that every launch with it sums a row the same way whatever the row count.
    Narrow column blocks for narrow weights, so that a decode step's few rows still spread
    over many programs; long K steps and deep pipelines for long rows, so that each program
    keeps enough of its weight slab in flight; short ones where the programs outnumber the
    SMs several times, so that more of them fit on an SM at once. (Chosen from
    `benchmarks/bench_invariant_linear.py` at 1 and 64 rows on the H200.)"""
    many = n > 8192  # programs: several per SM at a decode step
    block_n = 16 if n <= 1024 else 32 if n <= 4096 else 64
    block_k = 64 if k <= 1024 or many else 128 if k <= 2048 or block_n == 64 else 256
    stages = 3 if many else 4
    while stages * (BLOCK_M + block_n) * block_k * element_size > SHARED_MEMORY:
        if stages > 2:
            stages -= 1
        else:  # float32 on long rows
            block_k //= 2
    return Config(block_n, block_k, 4, stages)


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
    USE_PDL: tl.constexpr,
):
    """Program (i, j): rows [j * BLOCK_M, ...) x columns [i * BLOCK_N, ...), K in order."""
    pdl.wait_for_previous(USE_PDL)  # before any read: x comes from the kernel before
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


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """x [m, K] (rows may be strided) @ weight [N, K].T (+ bias) -> [m, N], each row the same
    bits at any m. float32 multiplies in full precision (no TF32). config: the launch shape
    (benchmarks and tests; None: `config_for` the weight)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.is_contiguous()
    m = x.shape[0]
    n, k = weight.shape
    assert x.shape[1] == k, f"{tuple(x.shape)} @ {tuple(weight.shape)}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = config or config_for(n, k, weight.element_size())
    _invariant_linear_kernel[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m))](
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
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl.launch_args(x.device, m),  # when it launches, not what it computes
    )
    return out


def linear_any(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """`linear` while the mode is on, else the library GEMM: for projections (the LM head)
    that have no fast path of their own. Leading dimensions are flattened."""
    if not ENABLED:
        return F.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1])
    return linear(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])
