"""Paged split-K attention for a few queries per request, the same number for every request.

    o = few_query_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                            num_queries, scaling, num_splits, scratch, custom_mask=None)

The speculative forwards have this shape: a tree verify runs ND queries per request, a draft
decode step topk, a draft extend S+1, each over a request's whole KV. `extend_attention` gives
such a batch one program per (request, query head, block of queries), so at batch 1 a layer
runs H programs that each read every key, and the H / KH heads of a KV group read it again.
This kernel is `decode_attention`'s work split instead: a program per (request, KV head,
split) serves every query of the request for all heads of its KV group (num_queries x H / KH
rows of one tile), reads a contiguous run of whole key blocks once, and writes a partial
output and log-sum-exp; the last program of (request, KV head) to arrive combines the splits
and resets its counter, so the launch replays in a CUDA graph.

q [bs * num_queries, H * D] (rotated, request b's queries at rows b*num_queries ..); the new
tokens' K/V are already in the pool (`rotary.rope_and_store_kv`); request b attends the keys at
req_to_token[req_pool_indices[b], :seq_lens[b]]. Visibility is `extend_attention`'s: causal
(query j sits at position seq_len - num_queries + j) or a tree-local custom_mask
[bs, num_queries, width] (uint8 or bool) over the last `width` keys, earlier keys visible.
Every length comes from device tensors; `FewQueryScratch` holds the partials and counters.

`few_query_attend` is the fused form for batches whose new tokens are each request's last
num_queries keys (tree verify, the draft extend): it takes qkv straight from the projection,
rotates q and k (after the optional q/k RMSNorm) by the tokens' positions, and the split that
holds the last position attends the new keys from registers and stores their K/V; the other
splits read only the keys before them. One kernel per layer, as in decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2
from gpu_worker.kernels.decode_attention import choose_num_splits, dot_precision

BLOCK_N = 64
LOG2E = 1.4426950408889634
MAX_ROWS = 64  # num_queries x (H / KH) rows in one program's tile


def fits(num_queries: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a batch of num_queries queries per request fits one program's tile."""
    return 0 < num_queries * (num_heads // num_kv_heads) <= MAX_ROWS


@dataclass(frozen=True)
class FewQueryScratch:
    """Partials and arrival counters for batches of up to max_bs requests of num_queries
    queries (the splits of a batch of bs requests are `choose_num_splits(bs, ...)`)."""

    max_bs: int
    num_queries: int
    partial_o: torch.Tensor  # [units * num_queries * H * D] float32
    partial_lse: torch.Tensor  # [units * num_queries * H] float32
    counters: torch.Tensor  # [max_bs * KH] int32, zero between launches

    @classmethod
    def allocate(
        cls, max_bs: int, num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int,
        num_sms: int, device: torch.device,
    ) -> FewQueryScratch:  # fmt: skip
        units = max(bs * choose_num_splits(bs, num_kv_heads, num_sms)
                    for bs in range(1, max_bs + 1))  # fmt: skip
        rows = units * num_queries * num_heads
        return cls(
            max_bs,
            num_queries,
            torch.empty(rows * head_dim, device=device),
            torch.empty(rows, device=device),
            torch.zeros(max_bs * num_kv_heads, dtype=torch.int32, device=device),
        )


@triton.jit
def _rotate_rows(x1, x2, cos, sin, w1, w2, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """`rotary.rotate_halves` with a position per row: cos / sin [R, BLOCK_HALF]."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)[:, None]
        f1 = ((f1 * inv).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        f2 = ((f2 * inv).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    return (f1 * cos - f2 * sin).to(dtype), (f2 * cos + f1 * sin).to(dtype)


@triton.jit
def _few_query_kernel(
    q_ptr,
    positions_ptr,
    cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    loc_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    seq_lens_ptr,
    mask_ptr,
    partial_o_ptr,
    partial_lse_ptr,
    counter_ptr,
    q_stride,
    req_to_token_stride,
    mask_batch_stride,
    scale_log2,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    NUM_QUERIES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MASK_WIDTH: tl.constexpr,  # 0: causal
    FUSED: tl.constexpr,  # q_ptr is qkv: rotate, store the new K/V, attend them from registers
    HAS_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = NUM_HEADS // NUM_KV_HEADS
    half = HEAD_DIM // 2
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    row = tl.load(req_pool_indices_ptr + req).to(tl.int64)

    # Tile rows: query t of head kv_head * group + h at row t * group + h; head dims as halves.
    m = tl.arange(0, BLOCK_M)
    query = m // group
    heads = kv_head * group + m % group
    row_mask = m < NUM_QUERIES * group
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < half
    token = req * NUM_QUERIES + query  # [BLOCK_M] row of q / o
    q_offsets = token[:, None] * q_stride + heads[:, None] * HEAD_DIM + c[None, :]
    qc_mask = row_mask[:, None] & c_mask[None, :]
    q1 = tl.load(q_ptr + q_offsets, mask=qc_mask, other=0.0)
    q2 = tl.load(q_ptr + q_offsets + half, mask=qc_mask, other=0.0)
    if MASK_WIDTH > 0:
        window = seq_len - MASK_WIDTH  # keys before it are visible to every query
    else:
        window = seq_len - NUM_QUERIES
    query_pos = seq_len - NUM_QUERIES + query  # causal: the query's own position
    pool_end = seq_len  # keys read from the pool: [0, pool_end)
    if FUSED:  # the new tokens are the last NUM_QUERIES keys; they come from registers
        pool_end = seq_len - NUM_QUERIES
        qw1, qw2 = c.to(tl.float32), c.to(tl.float32)  # unused without norms
        if HAS_NORM:
            qw1 = tl.load(q_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
            qw2 = tl.load(q_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)
        position = tl.load(positions_ptr + token, mask=row_mask, other=0).to(tl.int64)
        qcos = tl.load(cache_ptr + position[:, None] * HEAD_DIM + c[None, :], mask=qc_mask,
                       other=0.0)  # fmt: skip
        qsin = tl.load(cache_ptr + position[:, None] * HEAD_DIM + half + c[None, :],
                       mask=qc_mask, other=0.0)  # fmt: skip
        q1, q2 = _rotate_rows(q1, q2, qcos, qsin, qw1, qw2, eps, HEAD_DIM, HAS_NORM)

    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    active = tl.minimum(num_blocks, NUM_SPLITS)  # splits with keys: short sequences use few
    if split >= active:
        return
    blocks_per_split = tl.cdiv(num_blocks, active)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, pool_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < end
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + pos, mask=pos_mask, other=0)
        kv_offsets = (slots.to(tl.int64)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + c[None, :]
        kv_mask = pos_mask[:, None] & c_mask[None, :]
        k1 = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        k2 = tl.load(k_ptr + kv_offsets + half, mask=kv_mask, other=0.0)
        qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
        qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        in_window = pos >= window
        if MASK_WIDTH > 0:
            local = tl.where(in_window, pos - window, 0)
            bits = tl.load(
                mask_ptr + req * mask_batch_stride + query[:, None] * MASK_WIDTH + local[None, :],
                mask=row_mask[:, None] & (in_window & pos_mask)[None, :], other=0,
            )  # fmt: skip
            visible = (~in_window)[None, :] | (bits != 0)
        else:
            visible = pos[None, :] <= query_pos[:, None]
        visible = visible & pos_mask[None, :] & row_mask[:, None]
        qk = tl.where(visible, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v1 = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        v2 = tl.load(v_ptr + kv_offsets + half, mask=kv_mask, other=0.0)
        p = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=DOT_PRECISION)
        acc2 = acc2 * alpha[:, None] + tl.dot(p, v2, input_precision=DOT_PRECISION)
        m_i = m_new

    if FUSED:
        if split == active - 1:  # the split that holds the last position: the new keys
            # (names of their own: a runtime branch may not retype the loop's tensors)
            j = tl.arange(0, BLOCK_Q)
            j_mask = j < NUM_QUERIES
            jc_mask = j_mask[:, None] & c_mask[None, :]
            new_token = req * NUM_QUERIES + j
            nk_offsets = new_token[:, None] * q_stride + (NUM_HEADS + kv_head) * HEAD_DIM
            nk1 = tl.load(q_ptr + nk_offsets + c[None, :], mask=jc_mask, other=0.0)
            nk2 = tl.load(q_ptr + nk_offsets + half + c[None, :], mask=jc_mask, other=0.0)
            nw1, nw2 = c.to(tl.float32), c.to(tl.float32)  # unused without norms
            if HAS_NORM:
                nw1 = tl.load(k_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
                nw2 = tl.load(k_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)
            key_pos = tl.load(positions_ptr + new_token, mask=j_mask, other=0).to(tl.int64)
            ncos = tl.load(cache_ptr + key_pos[:, None] * HEAD_DIM + c[None, :], mask=jc_mask,
                           other=0.0)  # fmt: skip
            nsin = tl.load(cache_ptr + key_pos[:, None] * HEAD_DIM + half + c[None, :],
                           mask=jc_mask, other=0.0)  # fmt: skip
            nk1, nk2 = _rotate_rows(nk1, nk2, ncos, nsin, nw1, nw2, eps, HEAD_DIM, HAS_NORM)
            v_head = NUM_HEADS + NUM_KV_HEADS + kv_head
            nv_offsets = new_token[:, None] * q_stride + v_head * HEAD_DIM
            nv1 = tl.load(q_ptr + nv_offsets + c[None, :], mask=jc_mask, other=0.0)
            nv2 = tl.load(q_ptr + nv_offsets + half + c[None, :], mask=jc_mask, other=0.0)
            s_new = tl.dot(q1, tl.trans(nk1), input_precision=DOT_PRECISION)
            s_new += tl.dot(q2, tl.trans(nk2), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_Q]
            if MASK_WIDTH > 0:
                new_bits = tl.load(
                    mask_ptr + req * mask_batch_stride + query[:, None] * MASK_WIDTH + j[None, :],
                    mask=row_mask[:, None] & j_mask[None, :], other=0,
                )  # fmt: skip
                sees = new_bits != 0
            else:
                sees = j[None, :] <= query[:, None]
            sees = sees & j_mask[None, :] & row_mask[:, None]
            s_new = tl.where(sees, s_new * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s_new, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p_new = tl.exp2(s_new - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p_new, 1)
            p_new = p_new.to(nv1.dtype)
            acc1 = acc1 * alpha[:, None] + tl.dot(p_new, nv1, input_precision=DOT_PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(p_new, nv2, input_precision=DOT_PRECISION)
            m_i = m_new
            slot = tl.load(loc_ptr + new_token, mask=j_mask, other=0).to(tl.int64)
            dst = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + c[None, :]
            tl.store(k_ptr + dst, nk1.to(k_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(k_ptr + dst + half, nk2.to(k_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(v_ptr + dst, nv1.to(v_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(v_ptr + dst + half, nv2.to(v_ptr.dtype.element_ty), mask=jc_mask)

    # Partial result, then the last program of (request, KV head) combines all splits.
    has_keys = l_i > 0
    inv_l = 1.0 / tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    unit = token * NUM_HEADS + heads  # [BLOCK_M] (query, head) of this request
    partial = unit * NUM_SPLITS + split
    po_offsets = partial[:, None] * HEAD_DIM + c[None, :]
    tl.store(partial_o_ptr + po_offsets, acc1 * inv_l[:, None], mask=qc_mask)
    tl.store(partial_o_ptr + po_offsets + half, acc2 * inv_l[:, None], mask=qc_mask)
    tl.store(partial_lse_ptr + partial, lse, mask=row_mask)
    tl.debug_barrier()  # every thread's partials are written before the arrival is counted
    counter = counter_ptr + req * NUM_KV_HEADS + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == active - 1:
        m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(0, active):
            lse_s = tl.load(partial_lse_ptr + unit * NUM_SPLITS + s, mask=row_mask,
                            other=float("-inf"), cache_modifier=".cg")  # fmt: skip
            m_max = tl.maximum(m_max, lse_s)
        m_max = tl.where(row_mask & (m_max > float("-inf")), m_max, 0.0)
        total = tl.zeros([BLOCK_M], tl.float32)
        out1 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
        out2 = tl.zeros([BLOCK_M, BLOCK_HALF], tl.float32)
        for s in range(0, active):
            index = unit * NUM_SPLITS + s
            lse_s = tl.load(partial_lse_ptr + index, mask=row_mask, other=float("-inf"),
                            cache_modifier=".cg")  # fmt: skip
            w = tl.exp2(lse_s - m_max)  # empty splits weigh 0
            offsets = index[:, None] * HEAD_DIM + c[None, :]
            out1 += w[:, None] * tl.load(partial_o_ptr + offsets, mask=qc_mask, other=0.0,
                                         cache_modifier=".cg")  # fmt: skip
            out2 += w[:, None] * tl.load(partial_o_ptr + offsets + half, mask=qc_mask,
                                         other=0.0, cache_modifier=".cg")  # fmt: skip
            total += w
        inv_total = 1.0 / tl.where(total > 0, total, 1.0)
        o_offsets = token[:, None] * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + c[None, :]
        o_type = o_ptr.dtype.element_ty
        tl.store(o_ptr + o_offsets, (out1 * inv_total[:, None]).to(o_type), mask=qc_mask)
        tl.store(o_ptr + o_offsets + half, (out2 * inv_total[:, None]).to(o_type), mask=qc_mask)
        tl.atomic_xchg(counter, 0)  # ready for the next launch


def few_query_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_queries: int,
    scaling: float,
    num_splits: int,
    scratch: FewQueryScratch,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """See the module docstring; q is rotated and the new K/V stored. Returns o
    [bs * num_queries, H * D] in q's dtype."""
    return _launch(q, q.shape[1] // k_buffer.shape[2], None, k_buffer, v_buffer, req_to_token,
                   req_pool_indices, seq_lens, num_queries, scaling, num_splits, scratch,
                   custom_mask)  # fmt: skip


@dataclass(frozen=True)
class NewTokens:
    """What the fused launch needs to rotate and store the new tokens itself: their positions
    and KV slots [bs * num_queries], the cos | sin cache, optional q / k RMSNorm weights."""

    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


def few_query_attend(
    qkv: torch.Tensor,
    num_heads: int,
    new: NewTokens,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_queries: int,
    scaling: float,
    num_splits: int,
    scratch: FewQueryScratch,
    custom_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same attention from qkv [bs * num_queries, (H + 2*KH) * D] when the new tokens are
    each request's last num_queries keys (custom_mask None or [bs, num_queries, num_queries]):
    q and k are rotated (and normalised) in the kernel, the new K/V stored at
    new.out_cache_loc by the split that attends them from registers (numerics of
    `rotary.rope_and_store_kv` followed by `few_query_attention`). Returns o as above."""
    assert custom_mask is None or custom_mask.shape[-1] == num_queries
    return _launch(qkv, num_heads, new, k_buffer, v_buffer, req_to_token, req_pool_indices,
                   seq_lens, num_queries, scaling, num_splits, scratch, custom_mask)  # fmt: skip


def _launch(q, num_heads, new: NewTokens | None, k_buffer, v_buffer, req_to_token,
            req_pool_indices, seq_lens, num_queries, scaling, num_splits, scratch,
            custom_mask):  # fmt: skip
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    bs = req_pool_indices.shape[0]
    assert q.shape[0] == bs * num_queries and fits(num_queries, num_heads, num_kv_heads)
    assert bs <= scratch.max_bs and num_queries == scratch.num_queries
    o = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    if bs == 0:
        return o
    if custom_mask is not None:  # rows of each request contiguous; requests may share one
        mask = custom_mask.view(torch.uint8) if custom_mask.dtype == torch.bool else custom_mask
        if mask.stride(2) != 1 or mask.stride(1) != mask.shape[2]:
            mask = mask.contiguous()
        mask_batch_stride, mask_width = mask.stride(0), mask.shape[2]
    else:
        mask, mask_batch_stride, mask_width = q, 0, 0  # unused
    fused = new is not None
    has_norm = fused and new.q_norm is not None
    group = num_heads // num_kv_heads
    _few_query_kernel[(bs, num_kv_heads, num_splits)](
        q, new.positions if fused else q, new.cos_sin_cache if fused else q,
        new.q_norm if has_norm else q, new.k_norm if has_norm else q,
        new.out_cache_loc if fused else q, k_buffer, v_buffer, o, req_to_token,
        req_pool_indices, seq_lens, mask, scratch.partial_o, scratch.partial_lse,
        scratch.counters, q.stride(0), req_to_token.stride(0), mask_batch_stride,
        scaling * LOG2E, new.eps if fused else 0.0,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HALF=max(16, next_power_of_2(head_dim // 2)), NUM_QUERIES=num_queries,
        BLOCK_M=max(16, next_power_of_2(num_queries * group)),
        BLOCK_Q=max(16, next_power_of_2(num_queries)), BLOCK_N=BLOCK_N,
        NUM_SPLITS=num_splits, MASK_WIDTH=mask_width, FUSED=fused, HAS_NORM=has_norm,
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
    )  # fmt: skip
    return o
