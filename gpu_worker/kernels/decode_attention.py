"""Paged decode attention: one query per request over its KV, split-K over the KV length.

    o = decode_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                         scaling, num_splits, partial_o, partial_lse)

q [bs, H * D]; k_buffer / v_buffer [num_slots, KH, D] (one layer of the KV pool);
req_to_token [rows, max_len] int32; req_pool_indices [bs]; seq_lens [bs] (keys attended).
Request b attends the keys at slots req_to_token[req_pool_indices[b], :seq_lens[b]].

Stage 1 runs a program per (request, KV head, split): the split covers a contiguous range of
whole BLOCK_N key blocks (seq_len divided over `num_splits`, so short sequences leave later
splits empty), and the program serves all H / KH query heads of its KV head at once (GQA: K
and V are read once per group). It writes a partial output and its log-sum-exp. Stage 2
combines the splits per (request, head). Everything it reads comes from device tensors, so
the launch never depends on host copies of seq_lens and can be captured in a CUDA graph.
partial_o [bs, H, num_splits, D] float32 and partial_lse [bs, H, num_splits] float32 are
scratch (at least that large; graphs pass preallocated ones).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2

BLOCK_N = 64
LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact products (the reference path is float32 too); tf32 would
    lose about three decimal digits. Other dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    partial_o_ptr,
    partial_lse_ptr,
    req_to_token_stride,
    scale_log2,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = NUM_HEADS // NUM_KV_HEADS
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    row = tl.load(req_pool_indices_ptr + req).to(tl.int64)
    blocks_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, seq_len)

    h = tl.arange(0, BLOCK_H)
    head_mask = h < group
    heads = kv_head * group + h
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offsets = req * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=head_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + pos, mask=pos_mask, other=0)
        kv_offsets = (slots.to(tl.int64)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        qk = qk * scale_log2  # log2 units
        qk = tl.where(pos_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    partial = (req * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H]
    tl.store(partial_o_ptr + partial[:, None] * HEAD_DIM + d[None, :], out,
             mask=head_mask[:, None] & d_mask[None, :])  # fmt: skip
    tl.store(partial_lse_ptr + partial, lse, mask=head_mask)


@triton.jit
def _decode_combine_kernel(
    partial_o_ptr,
    partial_lse_ptr,
    o_ptr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_SPLITS)
    s_mask = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    base = (req * NUM_HEADS + head) * NUM_SPLITS
    lse = tl.load(partial_lse_ptr + base + s, mask=s_mask, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # empty splits weigh 0
    partial = tl.load(partial_o_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :],
                      mask=s_mask[:, None] & d_mask[None, :], other=0.0)  # fmt: skip
    out = tl.sum(partial * weights[:, None], 0) / tl.sum(weights, 0)
    o_offsets = (req * NUM_HEADS + head) * HEAD_DIM + d
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=d_mask)


def decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scaling: float,
    num_splits: int,
    partial_o: torch.Tensor,
    partial_lse: torch.Tensor,
) -> torch.Tensor:
    """See the module docstring; returns o [bs, H * D] in q's dtype."""
    bs = q.shape[0]
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    num_heads = q.shape[1] // head_dim
    o = torch.empty_like(q)
    if bs == 0:
        return o
    block_d = next_power_of_2(head_dim)
    _decode_split_kernel[(bs, num_kv_heads, num_splits)](
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
        partial_o, partial_lse, req_to_token.stride(0), scaling * LOG2E,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_H=max(16, next_power_of_2(num_heads // num_kv_heads)), BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    _decode_combine_kernel[(bs, num_heads)](
        partial_o, partial_lse, o,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_splits,
        BLOCK_SPLITS=next_power_of_2(num_splits), num_warps=2,
    )  # fmt: skip
    return o


def choose_num_splits(bs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per (request, KV head) so that a decode launch has about two programs per SM."""
    wanted = math.ceil(2 * num_sms / max(bs * num_kv_heads, 1))
    return max(1, min(max_splits, next_power_of_2(wanted)))


def partial_buffers(
    bs: int, num_heads: int, num_splits: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scratch for `decode_attention`: partial_o [bs, H, splits, D], partial_lse [bs, H, splits]
    (float32)."""
    partial_o = torch.empty(bs, num_heads, num_splits, head_dim, device=device)
    partial_lse = torch.empty(bs, num_heads, num_splits, device=device)
    return partial_o, partial_lse
