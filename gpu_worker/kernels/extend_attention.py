"""Paged extend attention: several queries per request over its whole KV, causal or masked.

One program per (request, query head, block of BLOCK_M queries); max_extend_len, a host value
that comes with the plan, sizes the grid, and blocks past a request's own extend return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2
from gpu_worker.kernels.decode_attention import dot_precision

LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    req_to_token_ptr,
    rows_ptr,
    seq_lens_ptr,
    extend_seq_lens_ptr,
    extend_start_loc_ptr,
    mask_ptr,
    req_to_token_stride,
    scale_log2,
    mask_batch_stride,
    mask_width,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(extend_seq_lens_ptr + req).to(tl.int32)
    if m_block * BLOCK_M >= extend_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    row = tl.load(rows_ptr + req).to(tl.int64)
    token_start = tl.load(extend_start_loc_ptr + req).to(tl.int64)
    kv_head = head // (NUM_HEADS // NUM_KV_HEADS)
    committed_len = seq_len - extend_len

    m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = m < extend_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offsets = (token_start + m)[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = committed_len + m

    if HAS_MASK:
        key_end = seq_len
        mask_start = seq_len - mask_width
    else:  # causal: no key past this block's last query
        key_end = tl.minimum(seq_len, committed_len + (m_block + 1) * BLOCK_M)
        mask_start = seq_len
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block_start in range(0, key_end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < key_end
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + pos, mask=pos_mask, other=0)
        kv_offsets = (slots.to(tl.int64)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        qk = qk * scale_log2  # log2 units
        if HAS_MASK:
            col = pos - mask_start
            in_tree = (col >= 0) & pos_mask
            tree_offsets = req * mask_batch_stride + m[:, None] * mask_width + col[None, :]
            tree = tl.load(
                mask_ptr + tree_offsets, mask=m_mask[:, None] & in_tree[None, :], other=0
            )
            visible = ((col < 0)[None, :] | (tree != 0)) & pos_mask[None, :]
        else:
            visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key seen yet
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offsets = (token_start + m)[:, None] * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :]
    tl.store(
        o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :]
    )


def kernel_mask(custom_mask: torch.Tensor | None, dummy: torch.Tensor):
    """A tree-local custom mask [bs, q_len, width] as the attention kernels read it -> (uint8
    mask with each request's rows contiguous (requests may share one: batch stride 0), batch
    stride, width); without a mask: (dummy, 0, 0), never read."""
    if custom_mask is None:
        return dummy, 0, 0
    mask = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
    if mask.stride(2) != 1 or mask.stride(1) != mask.shape[2]:
        mask = mask.contiguous()
    return mask, mask.stride(0), mask.shape[2]


def extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    scaling: float,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [num_tokens, H * D], requests' tokens back to back (request b's from
    extend_start_loc[b]); k_buffer / v_buffer [num_slots, KH, D], one layer, the new K/V
    already stored; req_to_token [rows, max_len] int32; rows, seq_lens (keys attended),
    extend_seq_lens, extend_start_loc [bs] on the device. Request b's query j sits at position
    seq_len - extend_len + j and reads the keys at req_to_token[row, :seq_len], so page size
    never reaches the kernel. Visibility: causal, or a tree-local custom_mask [bs, q_len,
    width] (uint8 or bool) over the last width keys, earlier keys visible. Returns o
    [num_tokens, H * D] in q's dtype."""
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    num_heads = q.shape[1] // head_dim
    bs = rows.shape[0]
    # Zeros, not uninitialised memory, for tokens of no request (a prefill graph's padding):
    # their K/V go to the dummy slot, which then holds finite values.
    o = torch.zeros_like(q)
    if bs == 0 or q.shape[0] == 0:
        return o
    block_m = 16 if max_extend_len <= 16 else 64
    has_mask = custom_mask is not None
    mask, mask_batch_stride, mask_width = kernel_mask(custom_mask, q)
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        o,
        req_to_token,
        rows,
        seq_lens,
        extend_seq_lens,
        extend_start_loc,
        mask,
        req_to_token.stride(0),
        scaling * LOG2E,
        mask_batch_stride,
        mask_width,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=64,
        HAS_MASK=has_mask,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    return o
