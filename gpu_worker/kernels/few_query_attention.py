"""Paged split-K attention for a few queries per request, the same number for every request.

The speculative forwards' shape (a tree verify's ND queries, a draft step's topk, a draft
extend's S+1) with `decode_attention`'s work split: a program per (request, KV head, split)
serves all the request's queries for every head of its KV group, so each key is read once.
`few_query_attend` is the fused form (RoPE and the K/V store in the same kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2, pdl
from gpu_worker.kernels.decode_attention import (
    DecodeScratch,
    active_splits,
    dot_precision,
    finish_split,
    load_key_block,
    min_blocks_per_split,
    online_update,
    store_output,
)
from gpu_worker.kernels.extend_attention import kernel_mask
from gpu_worker.kernels.rotary import rotate_halves

LOG2E = 1.4426950408889634
MAX_ROWS = 64  # num_queries x (H / KH) rows in one program's tile


@dataclass(frozen=True)
class Knobs:
    """A launch's tuning: keys per loop iteration, the least keys a split covers (None:
    decode's MIN_KEYS_PER_SPLIT) and warps per program."""

    block_n: int = 64
    min_keys: int | None = None
    num_warps: int = 4


def choose_launch(block_m: int, head_dim: int) -> Knobs:
    """The launch for a tile of block_m query rows: as many keys per loop iteration as keep
    the key tile at 16K elements and the score tile at 4K (each iteration is a dependent
    round trip to memory, so fewer, wider ones are faster while registers hold them), from
    `bench_decode_attention.py --queries 4` at the 135M and 8B shapes (docs/performance.md,
    "Attention"); eight warps were never faster than four."""
    block_n = min(16384 // head_dim, 4096 // block_m, 256)
    return Knobs(block_n=max(32, 1 << (block_n.bit_length() - 1)))


def fits(num_queries: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether a batch of num_queries queries per request fits one program's tile."""
    return 0 < num_queries * (num_heads // num_kv_heads) <= MAX_ROWS


def scratch_for(
    max_bs: int,
    num_queries: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_sms: int,
    device: torch.device,
) -> DecodeScratch:
    """Decode's partials and counters, with a row per (query, head) of each request."""
    return DecodeScratch.allocate(
        max_bs, num_queries * num_heads, num_kv_heads, head_dim, num_sms, device
    )


@triton.jit
def _load_rotated(
    ptr,
    offsets,
    rows,
    rows_mask,
    positions_ptr,
    cache_ptr,
    norm_ptr,
    eps,
    c,
    c_mask,
    HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Head rows [R, D] at ptr + offsets (offsets of the first half) as halves, RMS-normalised
    with norm_ptr's weights (HAS_NORM) and rotated by the position of token rows[r]; rounded
    to the input dtype like `rotary.rope_and_store_kv`'s output."""
    half = HEAD_DIM // 2
    mask = rows_mask[:, None] & c_mask[None, :]
    x1 = tl.load(ptr + offsets, mask=mask, other=0.0)
    x2 = tl.load(ptr + offsets + half, mask=mask, other=0.0)
    position = tl.load(positions_ptr + rows, mask=rows_mask, other=0).to(tl.int64)
    cos = tl.load(cache_ptr + position[:, None] * HEAD_DIM + c[None, :], mask=mask, other=0.0)
    sin = tl.load(
        cache_ptr + position[:, None] * HEAD_DIM + half + c[None, :], mask=mask, other=0.0
    )
    w1, w2 = c.to(tl.float32), c.to(tl.float32)  # unused without norms
    if HAS_NORM:
        w1 = tl.load(norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)
    x1, x2 = rotate_halves(x1, x2, cos, sin, w1, w2, eps, HEAD_DIM, HAS_NORM)
    return x1.to(ptr.dtype.element_ty), x2.to(ptr.dtype.element_ty)


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
    rows_ptr,
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
    MIN_BLOCKS_PER_SPLIT: tl.constexpr,
    MASK_WIDTH: tl.constexpr,  # 0: causal
    FUSED: tl.constexpr,  # q_ptr is qkv: rotate, store the new K/V, attend them from registers
    HAS_NORM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.wait_for_previous(USE_PDL)  # everything it reads may come from the kernel before
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group = NUM_HEADS // NUM_KV_HEADS
    half = HEAD_DIM // 2
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    row = tl.load(rows_ptr + req).to(tl.int64)

    # Tile rows: query t of head kv_head * group + h at row t * group + h; head dims as halves.
    m = tl.arange(0, BLOCK_M)
    query = m // group
    heads = kv_head * group + m % group
    row_mask = m < NUM_QUERIES * group
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < half
    token = req * NUM_QUERIES + query  # [BLOCK_M] row of q / o
    q_offsets = token[:, None] * q_stride + heads[:, None] * HEAD_DIM + c[None, :]
    if FUSED:  # q_ptr is qkv: q rotated here
        q1, q2 = _load_rotated(
            q_ptr,
            q_offsets,
            token,
            row_mask,
            positions_ptr,
            cache_ptr,
            q_norm_ptr,
            eps,
            c,
            c_mask,
            HEAD_DIM,
            HAS_NORM,
        )
    else:
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

    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    active = active_splits(num_blocks, MIN_BLOCKS_PER_SPLIT, NUM_SPLITS)
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
        qk, v1, v2 = load_key_block(
            q1,
            q2,
            k_ptr,
            v_ptr,
            req_to_token_ptr,
            row,
            req_to_token_stride,
            pos,
            pos_mask,
            kv_head,
            c,
            c_mask,
            NUM_KV_HEADS,
            HEAD_DIM,
            DOT_PRECISION,
        )
        in_window = pos >= window
        if MASK_WIDTH > 0:
            local = tl.where(in_window, pos - window, 0)
            bits = tl.load(
                mask_ptr + req * mask_batch_stride + query[:, None] * MASK_WIDTH + local[None, :],
                mask=row_mask[:, None] & (in_window & pos_mask)[None, :],
                other=0,
            )
            visible = (~in_window)[None, :] | (bits != 0)
        else:
            visible = pos[None, :] <= query_pos[:, None]
        visible = visible & pos_mask[None, :] & row_mask[:, None]
        qk = tl.where(visible, qk * scale_log2, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_i, l_i, acc1, acc2 = online_update(qk, v1, v2, m_i, l_i, acc1, acc2, DOT_PRECISION)

    if FUSED:
        if split == active - 1:  # the split that holds the last position: the new keys
            # (names of their own: a runtime branch may not retype the loop's tensors)
            j = tl.arange(0, BLOCK_Q)
            j_mask = j < NUM_QUERIES
            jc_mask = j_mask[:, None] & c_mask[None, :]
            new_token = req * NUM_QUERIES + j
            nk_offsets = (
                new_token[:, None] * q_stride + (NUM_HEADS + kv_head) * HEAD_DIM + c[None, :]
            )
            nk1, nk2 = _load_rotated(
                q_ptr,
                nk_offsets,
                new_token,
                j_mask,
                positions_ptr,
                cache_ptr,
                k_norm_ptr,
                eps,
                c,
                c_mask,
                HEAD_DIM,
                HAS_NORM,
            )
            v_head = NUM_HEADS + NUM_KV_HEADS + kv_head
            nv_offsets = new_token[:, None] * q_stride + v_head * HEAD_DIM
            nv1 = tl.load(q_ptr + nv_offsets + c[None, :], mask=jc_mask, other=0.0)
            nv2 = tl.load(q_ptr + nv_offsets + half + c[None, :], mask=jc_mask, other=0.0)
            s_new = tl.dot(q1, tl.trans(nk1), input_precision=DOT_PRECISION)
            s_new += tl.dot(q2, tl.trans(nk2), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_Q]
            if MASK_WIDTH > 0:
                new_bits = tl.load(
                    mask_ptr + req * mask_batch_stride + query[:, None] * MASK_WIDTH + j[None, :],
                    mask=row_mask[:, None] & j_mask[None, :],
                    other=0,
                )
                sees = new_bits != 0
            else:
                sees = j[None, :] <= query[:, None]
            sees = sees & j_mask[None, :] & row_mask[:, None]
            s_new = tl.where(sees, s_new * scale_log2, float("-inf"))
            m_i, l_i, acc1, acc2 = online_update(
                s_new, nv1, nv2, m_i, l_i, acc1, acc2, DOT_PRECISION
            )
            slot = tl.load(loc_ptr + new_token, mask=j_mask, other=0).to(tl.int64)
            dst = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + c[None, :]
            tl.store(k_ptr + dst, nk1.to(k_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(k_ptr + dst + half, nk2.to(k_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(v_ptr + dst, nv1.to(v_ptr.dtype.element_ty), mask=jc_mask)
            tl.store(v_ptr + dst + half, nv2.to(v_ptr.dtype.element_ty), mask=jc_mask)

    # One split: the output. Several: a partial result, then the last program of (request,
    # KV head) combines all splits.
    unit = token * NUM_HEADS + heads
    if active == 1:
        store_output(acc1, acc2, l_i, unit, row_mask[:, None] & c_mask[None, :], c, o_ptr, HEAD_DIM)
    else:
        counter = counter_ptr + req * NUM_KV_HEADS + kv_head
        finish_split(
            acc1,
            acc2,
            m_i,
            l_i,
            unit,
            row_mask,
            c,
            c_mask,
            split,
            active,
            counter,
            partial_o_ptr,
            partial_lse_ptr,
            o_ptr,
            HEAD_DIM,
            NUM_SPLITS,
            BLOCK_M,
            BLOCK_HALF,
        )


def few_query_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_queries: int,
    scaling: float,
    num_splits: int,
    scratch: DecodeScratch,
    custom_mask: torch.Tensor | None = None,
    knobs: Knobs | None = None,
) -> torch.Tensor:
    """q [bs * num_queries, H * D], rotated (request b's queries from row b*num_queries), the
    new K/V already in the pool; request b attends the keys at req_to_token[rows[b],
    :seq_lens[b]], causally (query j at position seq_len - num_queries + j) or through a
    tree-local custom_mask [bs, num_queries, width] (uint8 or bool) over its last width keys,
    earlier keys visible. scratch: `scratch_for`. Returns o [bs * num_queries, H * D] in q's
    dtype. knobs: `choose_launch`'s unless given."""
    return _launch(
        q,
        q.shape[1] // k_buffer.shape[2],
        None,
        k_buffer,
        v_buffer,
        req_to_token,
        rows,
        seq_lens,
        num_queries,
        scaling,
        num_splits,
        scratch,
        custom_mask,
        knobs,
    )


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
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_queries: int,
    scaling: float,
    num_splits: int,
    scratch: DecodeScratch,
    custom_mask: torch.Tensor | None = None,
    knobs: Knobs | None = None,
) -> torch.Tensor:
    """The same attention from qkv [bs * num_queries, (H + 2*KH) * D] when the new tokens are
    each request's last num_queries keys (custom_mask None or [bs, num_queries, num_queries]):
    q and k are rotated (and normalised) in the kernel, the new K/V stored at
    new.out_cache_loc by the split that attends them from registers (numerics of
    `rotary.rope_and_store_kv` followed by `few_query_attention`). Returns o as above."""
    assert custom_mask is None or custom_mask.shape[-1] == num_queries
    return _launch(
        qkv,
        num_heads,
        new,
        k_buffer,
        v_buffer,
        req_to_token,
        rows,
        seq_lens,
        num_queries,
        scaling,
        num_splits,
        scratch,
        custom_mask,
        knobs,
    )


def _launch(
    q,
    num_heads,
    new: NewTokens | None,
    k_buffer,
    v_buffer,
    req_to_token,
    rows,
    seq_lens,
    num_queries,
    scaling,
    num_splits,
    scratch,
    custom_mask,
    knobs: Knobs | None = None,
):
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    bs = rows.shape[0]
    assert q.shape[0] == bs * num_queries and fits(num_queries, num_heads, num_kv_heads)
    assert bs <= scratch.max_bs
    o = torch.empty(q.shape[0], num_heads * head_dim, dtype=q.dtype, device=q.device)
    if bs == 0:
        return o
    mask, mask_batch_stride, mask_width = kernel_mask(custom_mask, q)
    fused = new is not None
    has_norm = fused and new.q_norm is not None
    group = num_heads // num_kv_heads
    block_m = max(16, next_power_of_2(num_queries * group))
    knobs = knobs or choose_launch(block_m, head_dim)
    _few_query_kernel[(bs, num_kv_heads, num_splits)](
        q,
        new.positions if fused else q,
        new.cos_sin_cache if fused else q,
        new.q_norm if has_norm else q,
        new.k_norm if has_norm else q,
        new.out_cache_loc if fused else q,
        k_buffer,
        v_buffer,
        o,
        req_to_token,
        rows,
        seq_lens,
        mask,
        scratch.partial_o,
        scratch.partial_lse,
        scratch.counters,
        q.stride(0),
        req_to_token.stride(0),
        mask_batch_stride,
        scaling * LOG2E,
        new.eps if fused else 0.0,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=max(16, next_power_of_2(head_dim // 2)),
        NUM_QUERIES=num_queries,
        BLOCK_M=block_m,
        BLOCK_Q=max(16, next_power_of_2(num_queries)),
        BLOCK_N=knobs.block_n,
        NUM_SPLITS=num_splits,
        MIN_BLOCKS_PER_SPLIT=min_blocks_per_split(knobs.block_n, knobs.min_keys),
        MASK_WIDTH=mask_width,
        FUSED=fused,
        HAS_NORM=has_norm,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=knobs.num_warps,
        **pdl.launch_args(q.device, q.shape[0]),
    )
    return o
