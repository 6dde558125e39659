"""The LM head and the argmax over its logits in two launches, for rows that need only their
greedy token (a plain greedy batch's verify, a chain's draft steps).

Each program projects a block of rows onto a block of the vocabulary, rounds the logits to the
model dtype as the library GEMM does and keeps each row's largest; a second launch reduces the
blocks (ties to the lowest id, as `torch.argmax`) and maps the winner through `hot_token_id`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2
from gpu_worker.sampling import DrawNoise, coupled_reference

BLOCK_M = 16  # rows per program: the smallest tile of a tensor-core dot
BLOCK_K = 64
# Rows beyond which the library GEMM, which reads each weight tile once for all rows, wins: the
# fused head reads the weight once per block of BLOCK_M rows.
MAX_ROWS = 4 * BLOCK_M


def greedy_head_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    token_map: torch.Tensor | None = None,
    noise: DrawNoise | None = None,
) -> torch.Tensor:
    """x [M, K], weight [V, K] -> [M] int64: argmax of the logits x @ weight.T (in x's dtype;
    with `noise`, its coupled proposal), mapped through token_map [V] where given."""
    logits = torch.nn.functional.linear(x, weight).float()
    ids = logits.argmax(dim=-1) if noise is None else coupled_reference(logits, noise)
    return ids if token_map is None else token_map[ids]


@triton.jit
def _hash32(x):
    """`sampling.hash32` on int64 values in [0, 2^32)."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x5BD1E995) & 0xFFFFFFFF
    return x ^ (x >> 16)


def fits(rows: int) -> bool:
    return rows <= MAX_ROWS


@triton.jit
def _block_max_kernel(
    x_ptr,
    w_ptr,
    max_ptr,
    index_ptr,
    scale_ptr,
    keys_ptr,
    noisy_ptr,
    columns_ptr,
    M,
    V,
    K: tl.constexpr,
    stride_x,
    stride_w,
    NUM_BLOCKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    NOISE: tl.constexpr,
):
    block, row_block = tl.program_id(0), tl.program_id(1)
    rows = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_x + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :] * stride_w + ks[:, None],
            mask=(cols[None, :] < V) & (ks[:, None] < K),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    logits = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # rounded as the GEMM output is
    if NOISE:
        scale = tl.load(scale_ptr + rows, mask=rows < M, other=1.0)
        noisy = tl.load(noisy_ptr + rows, mask=rows < M, other=0) != 0
        keys = tl.load(keys_ptr + rows, mask=rows < M, other=0)
        columns = tl.load(columns_ptr + cols, mask=cols < V, other=0)
        bits = _hash32(keys[:, None] ^ columns[None, :])
        u = ((bits >> 9) * 2 + 1).to(tl.float32) * (2.0**-24)
        gumbel = -tl.log(-tl.log(u))
        logits = tl.where(noisy[:, None], logits * scale[:, None] + gumbel, logits)
    logits = tl.where(cols[None, :] < V, logits, float("-inf"))
    best = tl.max(logits, axis=1)
    first = tl.min(tl.where(logits == best[:, None], cols[None, :], V), axis=1)
    out = rows * NUM_BLOCKS + block
    tl.store(max_ptr + out, best, mask=rows < M)
    tl.store(index_ptr + out, first, mask=rows < M)


@triton.jit
def _reduce_kernel(
    max_ptr,
    index_ptr,
    map_ptr,
    out_ptr,
    V,
    NUM_BLOCKS: tl.constexpr,
    BLOCKS_POW2: tl.constexpr,
    HAS_MAP: tl.constexpr,
):
    row = tl.program_id(0)
    blocks = tl.arange(0, BLOCKS_POW2)
    valid = blocks < NUM_BLOCKS
    maxima = tl.load(max_ptr + row * NUM_BLOCKS + blocks, mask=valid, other=float("-inf"))
    index = tl.load(index_ptr + row * NUM_BLOCKS + blocks, mask=valid, other=V)
    best = tl.max(maxima, axis=0)
    token = tl.min(tl.where(valid & (maxima == best), index, V), axis=0).to(tl.int64)
    if HAS_MAP:
        token = tl.load(map_ptr + token)
    tl.store(out_ptr + row, token)


def block_v(vocab: int, num_sms: int) -> int:
    """Columns per program: 128, or 64 where 128 would leave most SMs without a block."""
    return 128 if vocab >= 128 * num_sms else 64


def greedy_head(
    x: torch.Tensor,
    weight: torch.Tensor,
    token_map: torch.Tensor | None = None,
    num_sms: int = 132,
    noise: DrawNoise | None = None,
) -> torch.Tensor:
    """`greedy_head_reference` in two launches; x [M, K] (unit stride along K), M <= MAX_ROWS
    for speed (any M is correct)."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.stride(1) == 1
    rows, k = x.shape
    vocab = weight.shape[0]
    bv = block_v(vocab, num_sms)
    blocks = triton.cdiv(vocab, bv)
    maxima = torch.empty(rows, blocks, dtype=torch.float32, device=x.device)
    index = torch.empty(rows, blocks, dtype=torch.int32, device=x.device)
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    _block_max_kernel[(blocks, triton.cdiv(rows, BLOCK_M))](
        x,
        weight,
        maxima,
        index,
        *((noise.scale, noise.keys, noise.noisy, noise.columns) if noise else (maxima,) * 4),
        rows,
        vocab,
        K=k,
        stride_x=x.stride(0),
        stride_w=weight.stride(0),
        NUM_BLOCKS=blocks,
        BLOCK_M=BLOCK_M,
        BLOCK_V=bv,
        BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32,
        NOISE=noise is not None,
    )
    _reduce_kernel[(rows,)](
        maxima,
        index,
        token_map if token_map is not None else out,
        out,
        vocab,
        NUM_BLOCKS=blocks,
        BLOCKS_POW2=next_power_of_2(blocks),
        HAS_MAP=token_map is not None,
    )
    return out
