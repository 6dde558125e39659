"""Projections of two to `MAX_ROWS` rows (a chain's verify, the draft extend, plain decode of a
few requests) on the tensor cores, with the weight read before the PDL wait.

    linear(x, w, b)                          -> x @ w.T + b,  x [m, K] with 2 <= m <= MAX_ROWS
    rms_norm_linear(x, residual, nw, eps, w) -> (rms_norm(x + residual) @ w.T, x + residual)
    silu_mul_linear(gate_up, w, b)           -> silu_and_mul(gate_up) @ w.T + b

At a few rows a small weight's projection is latency: the library GEMM takes 3-4 us for a
weight it reads in well under one, and it cannot overlap the kernel before it. Here every
program owns BLOCK_N output columns over the whole input width: it loads its weight tile, waits
for the kernel before it (`pdl`), then loads the rows, padded to the 16-row tile of an MMA,
applies the step before the projection (the norm, with the residual add, or SiLU-and-multiply:
every program repeats it over the few rows, whose input is a few KB) and takes a batched
`tl.dot` whose parts along the input run on different warps. So under PDL the weight read
overlaps the previous kernel as in the one-row kernels (`small_m_linear`), the rows cost the
tensor cores nothing extra, and a decoder layer at a few rows is five kernels, not eight.

Numerics are the references' (`small_m_linear`'s): the normalised or gated input is rounded to
the input dtype, products accumulate in float32 (`ieee` for float32 inputs), then are rounded
once to the output dtype, like `F.linear`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2, pdl

MAX_ROWS = 16  # one MMA tile of rows
MIN_ROWS = 2  # one row runs `small_m_linear`'s kernels
BLOCK_N = 16
_PLAIN, _NORM, _ADD_NORM, _SILU_MUL = 0, 1, 2, 3  # the step fused before the projection
# Per row of a tile, the most input bytes: a bf16 tile of 1024 columns needs 128 KB of shared
# memory on the H100 (two 2048-column ones did not fit in its 227 KB); up to MAX_TILES tiles
# are read before the wait, wider inputs loop after it.
TILE_BYTES = 2048
MAX_TILES = 3
# Parts of a tile's input width that the warps reduce side by side. At the 135M shapes, 4 rows,
# per call in a CUDA graph on the H200: one part (one MMA chain along all of it) 3.4-5.3 us,
# four parts 3.0-4.4 us, the library GEMM 3.2-4.4 us; eight warps were slower at every split.
SPLIT = 4
NUM_WARPS = 4
# Fuse the norm or SiLU-and-multiply before a projection into it (False: its own kernel first).
FUSE_PROLOGUE = True


@triton.jit
def _weight_tile(w_ptr, n, n_ok, K, k0, SPLIT: tl.constexpr, PART: tl.constexpr):
    """[SPLIT, PART, BLOCK_N]: columns k0 .. k0 + SPLIT * PART of the weight, transposed, in
    SPLIT parts along the input."""
    k = k0 + tl.arange(0, SPLIT)[:, None, None] * PART + tl.arange(0, PART)[None, :, None]
    return tl.load(w_ptr + n[None, None, :] * K + k, mask=n_ok[None, None, :] & (k < K),
                   other=0.0)  # fmt: skip


@triton.jit
def _row_columns(k0, SPLIT: tl.constexpr, PART: tl.constexpr):
    """[SPLIT, 1, PART]: the input columns of a tile, as the rows' tile takes them."""
    return k0 + tl.arange(0, SPLIT)[:, None, None] * PART + tl.arange(0, PART)[None, None, :]


@triton.jit
def _rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps, PROLOGUE: tl.constexpr,
          SPLIT: tl.constexpr, PART: tl.constexpr):  # fmt: skip
    """[BLOCK_M] 1 / rms of each row of the norm's input (x, or x + residual rounded like the
    sum), over one tile that covers K."""
    k = _row_columns(0, SPLIT, PART)
    mask = row_ok[None, :, None] & (k < K)
    x = tl.load(x_ptr + rows[None, :, None] * x_stride + k, mask=mask, other=0.0)
    if PROLOGUE == 2:
        r = tl.load(res_ptr + rows[None, :, None] * res_stride + k, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(tl.sum(xf * xf, axis=2), axis=0) / K + eps)


@triton.jit
def _rows_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, row_ok, x_stride, res_stride, K, k0,
               rstd, store_sum, PROLOGUE: tl.constexpr, SPLIT: tl.constexpr,
               PART: tl.constexpr):  # fmt: skip
    """[SPLIT, BLOCK_M, PART]: the rows' tile of the projection's input in the input dtype,
    after the step fused before it (PROLOGUE: 0 none, 1 RMSNorm, 2 residual add + RMSNorm,
    3 SiLU-and-multiply of gate and up side by side), rounded as the references round."""
    k = _row_columns(k0, SPLIT, PART)
    mask = row_ok[None, :, None] & (k < K)
    x = tl.load(x_ptr + rows[None, :, None] * x_stride + k, mask=mask, other=0.0)
    if PROLOGUE == 3:
        up = tl.load(x_ptr + rows[None, :, None] * x_stride + K + k, mask=mask, other=0.0)
        gate = x.to(tl.float32)
        return (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(x.dtype)
    if PROLOGUE == 2:
        r = tl.load(res_ptr + rows[None, :, None] * res_stride + k, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # rounded like x + residual
        if store_sum:
            tl.store(sum_ptr + rows[None, :, None] * K + k, x, mask=mask)
    if PROLOGUE >= 1:
        w = tl.load(norm_w_ptr + k, mask=k < K, other=0.0)
        normed = (x.to(tl.float32) * rstd[None, :, None]).to(x.dtype)
        x = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    return x


@triton.jit
def _few_row_linear_kernel(
    x_ptr, res_ptr, sum_ptr, norm_w_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, x_stride, res_stride, out_stride, eps,
    PROLOGUE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, SPLIT: tl.constexpr, PART: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """TILES (1-3) > 0: the input width in that many tiles of SPLIT x PART columns, the
    weight's read before the wait; 0: a loop over such tiles after it (no norm prologue).
    A tile is one batched MMA over its SPLIT parts (each part's chain of MMAs on its own
    warps), summed."""
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    width: tl.constexpr = SPLIT * PART
    if TILES == 0:
        pdl.wait_for_previous(USE_PDL)
        for k0 in range(0, K, width):
            w = _weight_tile(w_ptr, n, n_ok, K, k0, SPLIT, PART)
            x = _rows_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, row_ok, x_stride,
                           res_stride, K, k0, tl.zeros([BLOCK_M], dtype=tl.float32), False,
                           PROLOGUE, SPLIT, PART)  # fmt: skip
            acc += tl.sum(tl.dot(x, w, input_precision=DOT_PRECISION), axis=0)
    else:  # the weight first, then the rows once they are written
        w0 = _weight_tile(w_ptr, n, n_ok, K, 0, SPLIT, PART)
        if TILES >= 2:
            w1 = _weight_tile(w_ptr, n, n_ok, K, width, SPLIT, PART)
        if TILES >= 3:
            w2 = _weight_tile(w_ptr, n, n_ok, K, 2 * width, SPLIT, PART)
        pdl.wait_for_previous(USE_PDL)
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        if PROLOGUE == 1 or PROLOGUE == 2:
            rstd = _rstd(x_ptr, res_ptr, rows, row_ok, x_stride, res_stride, K, eps, PROLOGUE,
                         SPLIT, PART)  # fmt: skip
        x = _rows_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, row_ok, x_stride, res_stride,
                       K, 0, rstd, pid == 0, PROLOGUE, SPLIT, PART)  # fmt: skip
        acc += tl.sum(tl.dot(x, w0, input_precision=DOT_PRECISION), axis=0)
        if TILES >= 2:
            x = _rows_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, row_ok, x_stride,
                           res_stride, K, width, rstd, pid == 0, PROLOGUE, SPLIT, PART)  # fmt: skip
            acc += tl.sum(tl.dot(x, w1, input_precision=DOT_PRECISION), axis=0)
        if TILES >= 3:
            x = _rows_tile(x_ptr, res_ptr, sum_ptr, norm_w_ptr, rows, row_ok, x_stride,
                           res_stride, K, 2 * width, rstd, pid == 0, PROLOGUE, SPLIT,
                           PART)  # fmt: skip
            acc += tl.sum(tl.dot(x, w2, input_precision=DOT_PRECISION), axis=0)
    acc += bias[None, :]
    tl.store(out_ptr + rows[:, None] * out_stride + n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])  # fmt: skip


def fits(rows: int) -> bool:
    return MIN_ROWS <= rows <= MAX_ROWS


def tiling(k: int, element_size: int) -> tuple[int, int]:
    """(BLOCK_K, TILES) for an input of width k: one to MAX_TILES tiles of at most TILE_BYTES
    per row (each tile's operands pass through shared memory on their way to the MMA), or a
    loop (TILES 0) over such tiles past that."""
    widest = TILE_BYTES // element_size
    block_k = max(min(next_power_of_2(k), widest), 16)
    tiles = triton.cdiv(k, block_k)
    return block_k, tiles if tiles <= MAX_TILES else 0


def norm_fits(k: int, element_size: int) -> bool:
    """Whether a norm over k columns fuses before the projection (one tile covers it)."""
    return tiling(k, element_size)[1] == 1


def _launch(prologue, x, weight, bias, residual, norm_weight, eps, block_k=None):
    rows = x.shape[0]
    assert fits(rows), f"{rows} rows: the kernel takes {MIN_ROWS}-{MAX_ROWS}"
    assert x.stride(-1) == 1 and weight.is_contiguous()
    n, k = weight.shape
    block_k, tiles = (block_k, 0) if block_k else tiling(k, x.element_size())
    assert tiles == 1 or prologue not in (_NORM, _ADD_NORM), "a norm needs one tile over K"
    split = min(SPLIT, block_k // 16)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    summed = torch.empty(rows, k, dtype=x.dtype, device=x.device) if prologue == _ADD_NORM else x
    res = residual if residual is not None else x
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _few_row_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        x, res, summed, norm_weight if norm_weight is not None else weight, weight,
        bias if bias is not None else weight, out, rows, n, k, x.stride(0), res.stride(0),
        out.stride(0), eps, PROLOGUE=prologue, HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS,
        BLOCK_N=BLOCK_N, TILES=tiles, SPLIT=split, PART=block_k // split,
        DOT_PRECISION=precision, num_warps=NUM_WARPS, **pdl.launch_args(x.device, rows),
    )  # fmt: skip
    return out, summed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           block_k: int | None = None) -> torch.Tensor:  # fmt: skip
    """x [m, K] (rows may be strided, 2 <= m <= MAX_ROWS) @ weight [N, K].T (+ bias) -> [m, N].
    block_k: force a loop over tiles of this width (tests); default `tiling`."""
    return _launch(_PLAIN, x, weight, bias, None, None, 0.0, block_k)[0]


def rms_norm_linear(x, residual, norm_weight, eps, weight, bias=None):
    """-> (rms_norm(x + residual) @ weight.T + bias, x + residual); residual None: the norm of
    x alone, and x itself second. The norm's width must fit one tile (`norm_fits`)."""
    prologue = _NORM if residual is None else _ADD_NORM
    return _launch(prologue, x, weight, bias, residual, norm_weight, eps)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, bias=None, block_k=None):
    """gate_up [m, 2I] -> (silu(gate) * up) @ weight [H, I].T + bias -> [m, H]."""
    assert gate_up.shape[1] == 2 * weight.shape[1]
    return _launch(_SILU_MUL, gate_up, weight, bias, None, None, 0.0, block_k)[0]
