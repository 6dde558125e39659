"""Paged extend attention: several queries per request over its whole KV, causal or masked.

One program per (request, query head, block of BLOCK_M queries, split of the keys);
max_extend_len, a host value that comes with the plan, sizes the grid, and blocks past a
request's own extend return at once. A few new tokens over a long prefix (a prompt reusing a
cached one) would leave most SMs idle while a few programs walk the whole prefix, so a launch
with few query blocks splits the keys (`extend_num_splits`): each split writes a normalised
partial and its log-sum-exp, and `_combine_kernel` merges them.

The deterministic mode (`batch_invariant`) runs every attention here with `invariant`: blocks
of one row count, one program per block and KV head over the whole row, each row a (query,
query head of that KV head) pair, so a decode step reads a KV head's keys once for its whole
group; key blocks at fixed multiples of 64 from position 0, so a query at position p reads its
keys in the same blocks, in the same order, whether it decodes alone, sits in a batch, is
verified in a chain or a tree of drafts or is prefilled in any chunk (a key block past p is
masked for it, which changes no bit; nor does the row a query takes in its block, every row of
a tile being summed alike). No key splits: their partials would take memory growing with the
context and a combine launch, and a split's boundaries would have to sit at fixed positions
too. A tree node's keys are its prefix and its ancestors, which sit at other indices than a
plain decode's keys: it runs alone in its program (a row per query head) and reads them in
logical order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2
from gpu_worker.kernels.decode_attention import dot_precision

LOG2E = 1.4426950408889634
MAX_SPLITS = 8
SPLIT_COUNTS = (1, 2, 4, 8)  # what extend_num_splits returns: each a compile of both kernels
MIN_SPLIT_KEYS = 256  # a split covers at least this many keys; shorter ranges stay in one
FORCED_SPLITS: int | None = None  # the start-up warm-up compiles each of SPLIT_COUNTS


def extend_block_m(max_extend_len: int, invariant: bool = False) -> int:
    """Queries per program (invariant: one size for every launch)."""
    return 16 if max_extend_len <= 16 or invariant else 64


def extend_num_splits(num_tokens: int, max_extend_len: int, num_heads: int, num_sms: int) -> int:
    """Key splits for a launch of num_tokens queries: enough programs to fill the SMs once,
    where the query blocks alone do not (a host decision from the batch's shape, so a graph
    captured for a bucket keeps it; whether a request's keys are long enough to split is
    decided in the kernel)."""
    if FORCED_SPLITS is not None:
        return FORCED_SPLITS
    programs = triton.cdiv(max(num_tokens, 1), extend_block_m(max_extend_len)) * num_heads
    wanted = min(MAX_SPLITS, num_sms // programs)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1  # a power of two


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
    partial_o_ptr,
    partial_lse_ptr,
    min_split_keys,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    INVARIANT: tl.constexpr,
    ONE_QUERY: tl.constexpr,
    WIDTH_P2: tl.constexpr,
    QUERIES: tl.constexpr,
):
    """Program (request, head, query block and split); INVARIANT: (request, KV head, query
    block), a block's rows the queries x the query heads of the KV head, so the group reads
    its keys once. ONE_QUERY (the invariant launch with a tree mask): program m_block runs
    query m_block alone (one row per head) over its keys in logical order: the prefix, then
    its ancestors in the tree, where a plain decode of the same token has them. QUERIES: per
    program (`extend_attention`)."""
    GROUP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    req = tl.program_id(0).to(tl.int64)
    m_block = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    extend_len = tl.load(extend_seq_lens_ptr + req).to(tl.int32)
    if m_block * QUERIES >= extend_len:
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    row = tl.load(rows_ptr + req).to(tl.int64)
    token_start = tl.load(extend_start_loc_ptr + req).to(tl.int64)
    committed_len = seq_len - extend_len

    r = tl.arange(0, BLOCK_M)
    if INVARIANT:  # row r: query r // GROUP of the block, head r % GROUP of the KV head's
        kv_head = tl.program_id(1)
        head = kv_head * GROUP + r % GROUP
        m = m_block * QUERIES + r // GROUP
        m_mask = (r < QUERIES * GROUP) & (m < extend_len)
    else:
        head = tl.program_id(1) + tl.zeros([BLOCK_M], tl.int32)
        kv_head = tl.program_id(1) // GROUP
        m = m_block * BLOCK_M + r
        m_mask = m < extend_len
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_offsets = ((token_start + m) * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = committed_len + m

    if ONE_QUERY:  # the query's tree keys, and its logical position after them
        mask_start = seq_len - mask_width
        t = tl.arange(0, WIDTH_P2)
        bits = tl.load(
            mask_ptr + req * mask_batch_stride + m_block * mask_width + t,
            mask=t < mask_width,
            other=0,
        )
        bits = (bits != 0).to(tl.int32)
        rank = tl.cumsum(bits, 0) - 1  # of each visible tree key among them
        key_end = mask_start + tl.sum(bits, 0)
        q_pos = key_end - 1 + tl.zeros([BLOCK_M], tl.int32)
    elif HAS_MASK:
        key_end = seq_len
        mask_start = seq_len - mask_width
    else:  # causal: no key past this block's last query
        key_end = tl.minimum(seq_len, committed_len + (m_block + 1) * QUERIES)
        mask_start = seq_len
    if INVARIANT:  # batch-invariant: the whole row, blocks from key 0 (NUM_SPLITS is 1)
        key_start = 0
        key_stop = key_end
    else:  # whole BLOCK_N blocks, at least min_split_keys of them, so a short range is one
        # split's and the others find theirs empty
        per_split = tl.maximum(
            tl.cdiv(tl.cdiv(key_end, NUM_SPLITS), BLOCK_N) * BLOCK_N, min_split_keys
        )
        key_start = tl.minimum(split * per_split, key_end)
        key_stop = tl.minimum(key_start + per_split, key_end)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for block_start in range(key_start, key_stop, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        pos_mask = pos < key_stop
        key = pos
        if ONE_QUERY:  # logical position -> the tree key holding it
            nth = pos - mask_start
            pick = (rank[None, :] == nth[:, None]) & (bits != 0)[None, :]
            tree_key = tl.sum(tl.where(pick, t[None, :], 0), 1)
            key = tl.where(nth >= 0, mask_start + tree_key, pos)
        slots = tl.load(req_to_token_ptr + row * req_to_token_stride + key, mask=pos_mask, other=0)
        kv_offsets = (slots.to(tl.int64)[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
        kv_mask = pos_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        qk = qk * scale_log2  # log2 units
        if HAS_MASK and not ONE_QUERY:
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
    store_mask = m_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_offsets = ((token_start + m) * NUM_HEADS + head)[:, None] * HEAD_DIM + d[None, :]
        tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=store_mask)
    else:  # every split writes, an empty one lse -inf (a row that saw no key: the same)
        part = ((token_start + m) * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(partial_o_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + part, lse, mask=m_mask)


@triton.jit(do_not_specialize=["bs"])  # any batch size, one compile
def _combine_kernel(
    o_ptr,
    partial_o_ptr,
    partial_lse_ptr,
    extend_seq_lens_ptr,
    extend_start_loc_ptr,
    bs,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    """o[token, head] from the splits' partials; zeros for a token of no request (a prefill
    graph's padding, past the last request's tokens), whose partials nobody wrote."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    last = bs - 1
    num_real = tl.load(extend_start_loc_ptr + last) + tl.load(extend_seq_lens_ptr + last)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    splits = tl.arange(0, NUM_SPLITS)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    real = tl.full([NUM_SPLITS], 0, tl.int64) + token < num_real
    lse = tl.where(real, tl.load(partial_lse_ptr + part), float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(real, top, 0.0)), 0.0)
    parts = tl.load(
        partial_o_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=(weight > 0)[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    o_offsets = token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d
    tl.store(o_ptr + o_offsets, out.to(o_ptr.dtype.element_ty), mask=d_mask)


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
    num_splits: int = 1,
    invariant: bool = False,
) -> torch.Tensor:
    """q [num_tokens, H * D], requests' tokens back to back (request b's from
    extend_start_loc[b]); k_buffer / v_buffer [num_slots, KH, D], one layer, the new K/V
    already stored; req_to_token [rows, max_len] int32; rows, seq_lens (keys attended),
    extend_seq_lens, extend_start_loc [bs] on the device. Request b's query j sits at position
    seq_len - extend_len + j and reads the keys at req_to_token[row, :seq_len], so page size
    never reaches the kernel. Visibility: causal, or a tree-local custom_mask [bs, q_len,
    width] (uint8 or bool) over the last width keys, earlier keys visible. num_splits: key
    splits (`extend_num_splits`). invariant: the batch-invariant launch (one split; with a
    tree mask, one query per program). Returns o [num_tokens, H * D] in q's dtype."""
    assert not invariant or num_splits == 1, "the invariant launch reads each row whole"
    num_kv_heads, head_dim = k_buffer.shape[1], k_buffer.shape[2]
    num_heads = q.shape[1] // head_dim
    bs = rows.shape[0]
    # Zeros, not uninitialised memory, for tokens of no request (a prefill graph's padding):
    # their K/V go to the dummy slot, which then holds finite values.
    o = torch.zeros_like(q) if num_splits == 1 or bs == 0 else torch.empty_like(q)
    if bs == 0 or q.shape[0] == 0:
        return o
    group = num_heads // num_kv_heads
    block_m = extend_block_m(max_extend_len, invariant)
    if invariant:  # rows: queries x the group's heads (a model's group: one size per model)
        block_m = max(block_m, next_power_of_2(group))
    has_mask = custom_mask is not None
    mask, mask_batch_stride, mask_width = kernel_mask(custom_mask, q)
    one_query = has_mask and invariant
    queries = (1 if one_query else block_m // group) if invariant else block_m
    heads = num_kv_heads if invariant else num_heads
    grid = (bs, heads, triton.cdiv(max_extend_len, queries) * num_splits)
    partial_o = partial_lse = q  # never read with one split
    if num_splits > 1:
        partial_o = q.new_empty((q.shape[0], num_heads, num_splits, head_dim), dtype=torch.float32)
        partial_lse = q.new_empty((q.shape[0], num_heads, num_splits), dtype=torch.float32)
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
        partial_o,
        partial_lse,
        MIN_SPLIT_KEYS,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=next_power_of_2(head_dim),
        BLOCK_M=block_m,
        BLOCK_N=64,
        HAS_MASK=has_mask,
        DOT_PRECISION=dot_precision(q.dtype),
        NUM_SPLITS=num_splits,
        INVARIANT=invariant,
        ONE_QUERY=one_query,
        WIDTH_P2=next_power_of_2(max(mask_width, 1)),
        QUERIES=queries,
        num_warps=4,
    )
    if num_splits > 1:
        _combine_kernel[(q.shape[0], num_heads)](
            o,
            partial_o,
            partial_lse,
            extend_seq_lens,
            extend_start_loc,
            bs,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=next_power_of_2(head_dim),
            NUM_SPLITS=num_splits,
        )
    return o
