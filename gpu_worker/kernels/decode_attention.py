"""Paged decode attention fused with RoPE and the K/V store: one kernel per layer and step.

Split-K and GQA grouped: a program per (request, KV head, split) serves all H / KH query heads
of its KV head over a contiguous run of key blocks; the last split of a (request, KV head) to
finish combines the partials and resets its counter, so the launch replays in CUDA graphs.
Every length is read from device tensors. `DecodeScratch` holds partials and counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2, pdl
from gpu_worker.kernels.rotary import rotate_halves

# A split's least keys: below it the combine's memory round trips cost more than the keys.
MIN_KEYS_PER_SPLIT = 256
LOG2E = 1.4426950408889634


def dot_precision(dtype: torch.dtype) -> str:
    """float32 models get exact products (the reference path is float32 too); tf32 would
    lose about three decimal digits. Other dtypes ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


@dataclass(frozen=True)
class DecodeScratch:
    """Partials and arrival counters for every batch size up to max_bs (the splits chosen for
    a batch of bs requests by `choose_num_splits`)."""

    max_bs: int
    partial_o: torch.Tensor  # [units * H * D] float32, units = max(bs * splits(bs))
    partial_lse: torch.Tensor  # [units * H] float32
    counters: torch.Tensor  # [max_bs * KH] int32, zero between launches

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        num_sms: int,
        device: torch.device,
    ) -> DecodeScratch:
        units = max(
            bs * choose_num_splits(bs, num_kv_heads, num_sms) for bs in range(1, max_bs + 1)
        )
        return cls(
            max_bs,
            torch.empty(units * num_heads * head_dim, device=device),
            torch.empty(units * num_heads, device=device),
            torch.zeros(max_bs * num_kv_heads, dtype=torch.int32, device=device),
        )


@triton.jit
def active_splits(num_blocks, MIN_BLOCKS_PER_SPLIT: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Splits of a request's num_blocks key blocks that hold keys: each covers at least
    MIN_BLOCKS_PER_SPLIT blocks, at most NUM_SPLITS of them; and one when splitting would save
    a single loop iteration, which the combine costs more than (docs/performance.md,
    "Attention")."""
    active = tl.maximum(tl.minimum(tl.cdiv(num_blocks, MIN_BLOCKS_PER_SPLIT), NUM_SPLITS), 1)
    if num_blocks - tl.cdiv(num_blocks, active) < 2:
        active = 1
    return active


@triton.jit
def load_key_block(
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
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Keys at positions pos [N] of a request's req_to_token row (pos_mask: which exist) for
    the query rows q1 / q2 [R, BLOCK_HALF] (head-dim halves): -> (q.k [R, N] float32, the
    value halves [N, BLOCK_HALF])."""
    slots = tl.load(req_to_token_ptr + row * req_to_token_stride + pos, mask=pos_mask, other=0)
    kv_offsets = (slots.to(tl.int64)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + c[None, :]
    kv_mask = pos_mask[:, None] & c_mask[None, :]
    half = HEAD_DIM // 2
    k1 = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
    k2 = tl.load(k_ptr + kv_offsets + half, mask=kv_mask, other=0.0)
    qk = tl.dot(q1, tl.trans(k1), input_precision=DOT_PRECISION)
    qk += tl.dot(q2, tl.trans(k2), input_precision=DOT_PRECISION)
    v1 = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptr + kv_offsets + half, mask=kv_mask, other=0.0)
    return qk, v1, v2


@triton.jit
def online_update(s, v1, v2, m_i, l_i, acc1, acc2, DOT_PRECISION: tl.constexpr):
    """Fold a block of keys into the running softmax of each row: s [R, N] scores in log2
    units, -inf where a key is not visible; v1 / v2 [N, BLOCK_HALF] -> (m_i, l_i, acc1, acc2)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v1.dtype)
    acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=DOT_PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(p, v2, input_precision=DOT_PRECISION)
    return m_new, l_i, acc1, acc2


@triton.jit
def store_output(out1, out2, total, unit, rc_mask, c, o_ptr, HEAD_DIM: tl.constexpr):
    """o rows unit [R] (each HEAD_DIM wide) = (out1 | out2) / total; rows whose total is 0
    (no keys, padding) get 0."""
    inv_total = 1.0 / tl.where(total > 0, total, 1.0)
    o_offsets = unit[:, None] * HEAD_DIM + c[None, :]
    o_type = o_ptr.dtype.element_ty
    tl.store(o_ptr + o_offsets, (out1 * inv_total[:, None]).to(o_type), mask=rc_mask)
    tl.store(
        o_ptr + o_offsets + HEAD_DIM // 2, (out2 * inv_total[:, None]).to(o_type), mask=rc_mask
    )


@triton.jit
def finish_split(
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
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Write this split's partial output and log-sum-exp for its rows (unit [R]: the
    (token, head) index of each row; o rows are unit * HEAD_DIM), count the split in; the last
    split of the counter to arrive combines them all into o and resets the counter, so the
    same launch replays in a CUDA graph."""
    half = HEAD_DIM // 2
    rc_mask = row_mask[:, None] & c_mask[None, :]
    has_keys = l_i > 0
    inv_l = 1.0 / tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    partial = unit * NUM_SPLITS + split
    po_offsets = partial[:, None] * HEAD_DIM + c[None, :]
    tl.store(partial_o_ptr + po_offsets, acc1 * inv_l[:, None], mask=rc_mask)
    tl.store(partial_o_ptr + po_offsets + half, acc2 * inv_l[:, None], mask=rc_mask)
    tl.store(partial_lse_ptr + partial, lse, mask=row_mask)
    tl.debug_barrier()  # every thread's partials are written before the arrival is counted
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == active - 1:
        m_max = tl.full([BLOCK_R], float("-inf"), tl.float32)
        for s in range(0, active):
            lse_s = tl.load(
                partial_lse_ptr + unit * NUM_SPLITS + s,
                mask=row_mask,
                other=float("-inf"),
                cache_modifier=".cg",
            )
            m_max = tl.maximum(m_max, lse_s)
        # padded rows and rows with no keys: no -inf minus -inf
        m_max = tl.where(row_mask & (m_max > float("-inf")), m_max, 0.0)
        total = tl.zeros([BLOCK_R], tl.float32)
        out1 = tl.zeros([BLOCK_R, BLOCK_HALF], tl.float32)
        out2 = tl.zeros([BLOCK_R, BLOCK_HALF], tl.float32)
        for s in range(0, active):
            index = unit * NUM_SPLITS + s
            lse_s = tl.load(
                partial_lse_ptr + index, mask=row_mask, other=float("-inf"), cache_modifier=".cg"
            )
            w = tl.exp2(lse_s - m_max)  # empty splits weigh 0
            offsets = index[:, None] * HEAD_DIM + c[None, :]
            out1 += w[:, None] * tl.load(
                partial_o_ptr + offsets, mask=rc_mask, other=0.0, cache_modifier=".cg"
            )
            out2 += w[:, None] * tl.load(
                partial_o_ptr + offsets + half, mask=rc_mask, other=0.0, cache_modifier=".cg"
            )
            total += w
        store_output(out1, out2, total, unit, rc_mask, c, o_ptr, HEAD_DIM)
        tl.atomic_xchg(counter, 0)  # ready for the next launch


@triton.jit
def _decode_kernel(
    qkv_ptr,
    positions_ptr,
    cache_ptr,
    q_norm_ptr,
    k_norm_ptr,
    k_ptr,
    v_ptr,
    loc_ptr,
    req_to_token_ptr,
    rows_ptr,
    seq_lens_ptr,
    o_ptr,
    partial_o_ptr,
    partial_lse_ptr,
    counter_ptr,
    qkv_stride,
    req_to_token_stride,
    scale_log2,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_BLOCKS_PER_SPLIT: tl.constexpr,
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
    new_pos = seq_len - 1  # the new token's key

    # The new token: rotated q of this group's heads, rotated k and v of this KV head.
    c = tl.arange(0, BLOCK_HALF)
    c_mask = c < half
    h = tl.arange(0, BLOCK_H)
    head_mask = h < group
    heads = kv_head * group + h
    position = tl.load(positions_ptr + req).to(tl.int64)
    cos = tl.load(cache_ptr + position * HEAD_DIM + c, mask=c_mask, other=0.0)
    sin = tl.load(cache_ptr + position * HEAD_DIM + half + c, mask=c_mask, other=0.0)
    w_q1, w_q2, w_k1, w_k2 = cos, cos, cos, cos  # unused without norms
    if HAS_NORM:
        w_q1 = tl.load(q_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        w_q2 = tl.load(q_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)
        w_k1 = tl.load(k_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32)
        w_k2 = tl.load(k_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32)
    base = qkv_ptr + req * qkv_stride
    qh_mask = head_mask[:, None] & c_mask[None, :]
    q_offsets = heads[:, None] * HEAD_DIM + c[None, :]
    q1 = tl.load(base + q_offsets, mask=qh_mask, other=0.0)
    q2 = tl.load(base + q_offsets + half, mask=qh_mask, other=0.0)
    dtype = q1.dtype
    q1, q2 = rotate_halves(q1, q2, cos[None, :], sin[None, :], w_q1, w_q2, eps, HEAD_DIM, HAS_NORM)
    q1, q2 = q1.to(dtype), q2.to(dtype)  # rounded like q stored by the unfused path
    k_offsets = ((NUM_HEADS + kv_head) * HEAD_DIM + c)[None, :]
    k1 = tl.load(base + k_offsets, mask=c_mask[None, :], other=0.0)
    k2 = tl.load(base + k_offsets + half, mask=c_mask[None, :], other=0.0)
    k1, k2 = rotate_halves(k1, k2, cos[None, :], sin[None, :], w_k1, w_k2, eps, HEAD_DIM, HAS_NORM)
    k1, k2 = k1.to(dtype).to(tl.float32), k2.to(dtype).to(tl.float32)  # [1, BLOCK_HALF]
    v_offsets = (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + c
    v1 = tl.load(base + v_offsets, mask=c_mask, other=0.0).to(tl.float32)
    v2 = tl.load(base + v_offsets + half, mask=c_mask, other=0.0).to(tl.float32)

    # This split's keys from the pool (the new key excluded: it is not stored yet).
    num_blocks = tl.cdiv(seq_len, BLOCK_N)
    active = active_splits(num_blocks, MIN_BLOCKS_PER_SPLIT, NUM_SPLITS)
    if split >= active:
        return
    blocks_per_split = tl.cdiv(num_blocks, active)
    start = split * blocks_per_split * BLOCK_N
    end = tl.minimum(start + blocks_per_split * BLOCK_N, seq_len)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_HALF], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = (pos < end) & (pos != new_pos)
        qk, pv1, pv2 = load_key_block(
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
        qk = tl.where(pos_mask[None, :], qk * scale_log2, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_i, l_i, acc1, acc2 = online_update(qk, pv1, pv2, m_i, l_i, acc1, acc2, DOT_PRECISION)

    # The new key, in the split that holds its position; that program also stores K/V.
    holds = (new_pos >= start) & (new_pos < end)
    s_new = tl.sum(q1.to(tl.float32) * k1 + q2.to(tl.float32) * k2, 1) * scale_log2
    s_new = tl.where(holds, s_new, float("-inf"))
    m_new = tl.maximum(m_i, s_new)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p_new = tl.exp2(s_new - m_safe)
    l_i = l_i * alpha + p_new
    acc1 = acc1 * alpha[:, None] + p_new[:, None] * v1[None, :]
    acc2 = acc2 * alpha[:, None] + p_new[:, None] * v2[None, :]
    m_i = m_new
    slot = tl.load(loc_ptr + req).to(tl.int64)
    kv_dst = (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM + c
    new_pos_vec = tl.zeros([BLOCK_HALF], tl.int32) + new_pos
    store_mask = c_mask & (new_pos_vec >= start) & (new_pos_vec < end)  # c_mask & holds
    k_type = k_ptr.dtype.element_ty
    tl.store(k_ptr + kv_dst, tl.reshape(k1, [BLOCK_HALF]).to(k_type), mask=store_mask)
    tl.store(k_ptr + kv_dst + half, tl.reshape(k2, [BLOCK_HALF]).to(k_type), mask=store_mask)
    tl.store(v_ptr + kv_dst, v1.to(v_ptr.dtype.element_ty), mask=store_mask)
    tl.store(v_ptr + kv_dst + half, v2.to(v_ptr.dtype.element_ty), mask=store_mask)

    # One split: the output. Several: a partial result, then the last program of (request,
    # KV head) combines all splits.
    unit = req * NUM_HEADS + heads
    if active == 1:
        rc_mask = head_mask[:, None] & c_mask[None, :]
        store_output(acc1, acc2, l_i, unit, rc_mask, c, o_ptr, HEAD_DIM)
    else:
        counter = counter_ptr + req * NUM_KV_HEADS + kv_head
        finish_split(
            acc1,
            acc2,
            m_i,
            l_i,
            unit,
            head_mask,
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
            BLOCK_H,
            BLOCK_HALF,
        )


def decode_attention(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    scaling: float,
    num_splits: int,
    scratch: DecodeScratch,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    min_keys_per_split: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """qkv [bs, (H + 2*KH) * D]: each request's one new token from the merged projection.
    Its q and k heads are (optionally RMS-normalised and) rotated by positions [bs] with
    cos_sin_cache [max_positions, D] (cos | sin), its k and v stored into one layer of the pool
    (k_buffer / v_buffer [num_slots, KH, D]) at out_cache_loc [bs]; then each request attends
    its keys at req_to_token[rows[b], :seq_lens[b]], the last (its new token) from registers.
    Numerics: `rotary.rope_and_store_kv`, then attention over the pool. A request served by
    one split writes o directly. Returns o [bs, H * D] in qkv's dtype. min_keys_per_split
    (default MIN_KEYS_PER_SPLIT), block_n and num_warps (default `choose_launch`) are tuning
    knobs for benchmarks."""
    bs = qkv.shape[0]
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    o = torch.empty(bs, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if bs == 0:
        return o
    has_norm = q_norm is not None
    chosen_block_n, chosen_warps = choose_launch(bs, num_kv_heads, head_dim)
    block_n, num_warps = block_n or chosen_block_n, num_warps or chosen_warps
    min_blocks = min_blocks_per_split(block_n, min_keys_per_split)
    _decode_kernel[(bs, num_kv_heads, num_splits)](
        qkv,
        positions,
        cos_sin_cache,
        q_norm if has_norm else qkv,
        k_norm if has_norm else qkv,
        k_buffer,
        v_buffer,
        out_cache_loc,
        req_to_token,
        rows,
        seq_lens,
        o,
        scratch.partial_o,
        scratch.partial_lse,
        scratch.counters,
        qkv.stride(0),
        req_to_token.stride(0),
        scaling * LOG2E,
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HALF=max(16, next_power_of_2(head_dim // 2)),
        BLOCK_H=max(16, next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_BLOCKS_PER_SPLIT=min_blocks,
        HAS_NORM=has_norm,
        DOT_PRECISION=dot_precision(qkv.dtype),
        num_warps=num_warps,
        **pdl.launch_args(qkv.device, bs),
    )
    return o


def min_blocks_per_split(block_n: int, min_keys: int | None = None) -> int:
    """Blocks of block_n keys a split covers at least (MIN_KEYS_PER_SPLIT keys by default)."""
    return -(-(min_keys or MIN_KEYS_PER_SPLIT) // block_n)


def choose_launch(bs: int, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """(keys per loop iteration, warps) for a decode launch, from
    benchmarks/bench_decode_attention.py (docs/performance.md, "Attention"): with few programs
    a wide block is best, because each iteration costs dependent memory round trips (slots,
    then their keys) rather than bandwidth. With many programs, half that width and, past 256
    (request, KV head) pairs, two warps, which keep more programs resident."""
    units = bs * num_kv_heads
    elements = 16384 if units <= 64 else 8192
    block_n = max(32, min(256, 1 << (elements // head_dim).bit_length() - 1))  # a power of 2
    return block_n, 2 if units >= 256 else 4


def choose_num_splits(bs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """Splits per (request, KV head) so that a decode launch has about two programs per SM."""
    wanted = math.ceil(2 * num_sms / max(bs * num_kv_heads, 1))
    return max(1, min(max_splits, next_power_of_2(wanted)))
