"""All-reduce of a tensor-parallel group's small messages through its peers' memory.

Every rank owns one block of GPU memory that the others have opened over CUDA IPC: a signal
pad (int64 flags, one per [program, rank]) and two halves, each a slot per rank of the largest
message. Ranks push: they write into the others' memory (a write over NVLink is posted; a read
waits a round trip) and read only their own:

- one-shot: each rank writes its whole message into slot `rank` of every rank, meets them at a
  barrier, and sums its slots (writes (N - 1) x size; one barrier: best for small messages);
- two-shot: each rank writes part q of its message to rank q, barrier, sums its own part and
  writes that sum to every rank, barrier, reads the others' summed parts (writes 2 (N - 1) / N
  x size in two barriers: better as messages grow, with more ranks).

Both sum in float32 in rank order 0..N-1 and round once, so every rank gets the same bits
(one-shot: the same sum in the same order; two-shot: each part is summed once), which keeps the
ranks' sampled tokens equal without a broadcast.

Barriers are per program: program b of every rank signals program b of the others by writing
its flag count into their pads (release, system scope) and waits for theirs in its own pad
(acquire); program b only reads what program b of the others wrote. Counts only grow (int64),
so nothing is reset between calls. Each call takes the half its call count selects: a rank
that starts call c has passed call c - 1's barrier, so every peer has finished call c - 2, the
last to use this half. All state lives in device memory and the kernels take no per-call host
values, so CUDA graphs capture and replay them; every call must use the same grid
(`programs`) for the counts to stay in step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import pdl

MAX_RANKS = 8
# Elements: messages are a multiple of it (`PeerAllReduce.fits`), and every program's span
# starts at one, so loads and stores move 16 bytes and more at a time.
ALIGN = tl.constexpr(16)


@triton.jit
def _peer_ptr(table_ptr, index, dtype: tl.constexpr):
    # every half starts 256-byte aligned: say so, or no access is vectorised
    return tl.multiple_of(tl.load(table_ptr + index).to(tl.pointer_type(dtype)), 16)


@triton.jit
def _barrier(pad_ptrs_ptr, program, rank, value, WORLD: tl.constexpr, MAX_RANKS: tl.constexpr):
    """Signal `value` to program `program` of every rank, then wait for all of theirs."""
    tl.debug_barrier()  # this program's writes before its signal
    slot = program * MAX_RANKS
    for p in tl.static_range(WORLD):
        peer_pad = _peer_ptr(pad_ptrs_ptr, p, tl.int64)
        tl.atomic_xchg(peer_pad + slot + rank, value, sem="release", scope="sys")
    own_pad = _peer_ptr(pad_ptrs_ptr, rank, tl.int64)
    for p in tl.static_range(WORLD):
        seen = tl.atomic_add(own_pad + slot + p, 0, sem="acquire", scope="sys")
        while seen < value:
            seen = tl.atomic_add(own_pad + slot + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # and everyone's reads after it


@triton.jit
def _span(part_start, part_end, program, span):
    start = part_start + program * span
    return start, tl.multiple_of(tl.minimum(start + span, part_end), ALIGN)


@triton.jit
def _push(
    src_ptr,
    bufs_ptr,
    half,
    first,
    last,
    offset,
    start,
    end,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write src[start:end] to [offset + start, offset + end) of the half of ranks
    first..last (a range, so one rank or all)."""
    dtype = src_ptr.dtype.element_ty
    for off in range(start, end, BLOCK):
        idx = tl.multiple_of(off, ALIGN) + tl.arange(0, BLOCK)
        mask = idx < end
        value = tl.load(src_ptr + idx, mask=mask)
        for p in tl.static_range(WORLD):
            if p >= first and p <= last:
                dst = _peer_ptr(bufs_ptr, half * WORLD + p, dtype)
                tl.store(dst + offset + idx, value, mask=mask)


@triton.jit
def _copy(src_ptr, dst_ptr, start, end, BLOCK: tl.constexpr):
    for off in range(start, end, BLOCK):
        idx = tl.multiple_of(off, ALIGN) + tl.arange(0, BLOCK)
        mask = idx < end
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)


@triton.jit
def _sum_slots(own_ptr, slot, x_ptr, start, end, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    """x[start:end] = the sum over slots (in rank order) of this rank's half there."""
    dtype = x_ptr.dtype.element_ty
    for off in range(start, end, BLOCK):
        idx = tl.multiple_of(off, ALIGN) + tl.arange(0, BLOCK)
        mask = idx < end
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            acc += tl.load(own_ptr + p * slot + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(x_ptr + idx, acc.to(dtype), mask=mask)


@triton.jit
def _start(counts_ptr, USE_PDL: tl.constexpr):
    """(calls, flag) of this program: the counts are written by the call before."""
    pdl.wait_for_previous(USE_PDL)
    program = tl.program_id(0)
    return tl.load(counts_ptr + 2 * program), tl.load(counts_ptr + 2 * program + 1)


@triton.jit
def _one_shot_kernel(
    x_ptr,
    n,
    span,
    slot,
    bufs_ptr,
    pad_ptrs_ptr,
    counts_ptr,
    rank,
    WORLD: tl.constexpr,
    MAX_RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    calls, flag = _start(counts_ptr, USE_PDL)
    program = tl.program_id(0)
    half = calls % 2
    start, end = _span(0, n, program, span)
    _push(x_ptr, bufs_ptr, half, 0, WORLD - 1, rank * slot, start, end, WORLD, BLOCK)
    _barrier(pad_ptrs_ptr, program, rank, flag + 1, WORLD, MAX_RANKS)
    own = _peer_ptr(bufs_ptr, half * WORLD + rank, x_ptr.dtype.element_ty)
    _sum_slots(own, slot, x_ptr, start, end, WORLD, BLOCK)
    tl.store(counts_ptr + 2 * program, calls + 1)
    tl.store(counts_ptr + 2 * program + 1, flag + 1)


@triton.jit
def _two_shot_kernel(
    x_ptr,
    n,
    part,
    span,
    slot,
    bufs_ptr,
    pad_ptrs_ptr,
    counts_ptr,
    rank,
    WORLD: tl.constexpr,
    MAX_RANKS: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rank q owns part q (elements [q * part, (q + 1) * part)); program b handles span b of
    every part. Rank r's slot on rank q holds part q of r's message, then r's sum of part r
    (another region of the slot)."""
    calls, flag = _start(counts_ptr, USE_PDL)
    program = tl.program_id(0)
    half = calls % 2
    for q in tl.static_range(WORLD):
        start, end = _span(q * part, tl.minimum((q + 1) * part, n), program, span)
        _push(x_ptr, bufs_ptr, half, q, q, rank * slot, start, end, WORLD, BLOCK)
    _barrier(pad_ptrs_ptr, program, rank, flag + 1, WORLD, MAX_RANKS)
    own = _peer_ptr(bufs_ptr, half * WORLD + rank, x_ptr.dtype.element_ty)
    start, end = _span(rank * part, tl.minimum((rank + 1) * part, n), program, span)
    _sum_slots(own, slot, x_ptr, start, end, WORLD, BLOCK)
    tl.debug_barrier()
    _push(x_ptr, bufs_ptr, half, 0, WORLD - 1, rank * slot, start, end, WORLD, BLOCK)
    _barrier(pad_ptrs_ptr, program, rank, flag + 2, WORLD, MAX_RANKS)
    for q in tl.static_range(WORLD):
        if q != rank:
            start, end = _span(q * part, tl.minimum((q + 1) * part, n), program, span)
            _copy(own + q * slot, x_ptr, start, end, BLOCK)
    tl.store(counts_ptr + 2 * program, calls + 1)
    tl.store(counts_ptr + 2 * program + 1, flag + 2)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _launch_args(x: torch.Tensor, block: int) -> dict:
    rows = x.shape[0] if x.dim() > 1 else 1
    return {"BLOCK": block, "num_warps": 4, **pdl.launch_args(x.device, rows)}


def all_reduce(
    x: torch.Tensor,
    bufs: torch.Tensor,
    pad_ptrs: torch.Tensor,
    counts: torch.Tensor,
    rank: int,
    slot_bytes: int,
    one_shot: bool,
    block: int = 1024,
) -> torch.Tensor:
    """Sum x (contiguous, a multiple of ALIGN elements) over the ranks in place, one-shot or
    two-shot (reduce-scatter, then all-gather). bufs: int64 [2, N] addresses of every rank's
    halves (N slots of slot_bytes each); pad_ptrs: int64 [N] addresses of their signal pads;
    counts: int64 [programs, 2] this rank's (calls, flags) per program, zeros at first."""
    world, programs = pad_ptrs.numel(), counts.shape[0]
    n, slot = x.numel(), slot_bytes // x.element_size()
    signals = (bufs, pad_ptrs, counts, rank, world, MAX_RANKS)
    if one_shot:
        span = _round_up(-(-n // programs), ALIGN.value)
        _one_shot_kernel[(programs,)](x, n, span, slot, *signals, **_launch_args(x, block))
    else:
        part = _round_up(-(-n // world), ALIGN.value)
        span = _round_up(-(-part // programs), ALIGN.value)
        _two_shot_kernel[(programs,)](x, n, part, span, slot, *signals, **_launch_args(x, block))
    return x
