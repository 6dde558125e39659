"""Turn a chosen batch into the columnar `ForwardPlan` the GPU worker runs. Pure.

Extend: each request runs `fill_ids[committed_len : committed_len + chunk_len]` at positions
committed_len, committed_len + 1, ... and writes KV at the chunk's slots; it samples on its final
chunk only.
Decode: the worker reads each row's last token and committed length on the device, so the
plan carries only rows and the KV slots newly assigned to them (positions no earlier plan
assigned: the next step's headroom, see `SchedulePolicy.decode_end`).
A request's row is (re)started (a `RequestStart`) the first time it runs on it.
"""

from __future__ import annotations

import numpy as np

from aerie.codec import pack_ids
from aerie.messages import ForwardPlan, RequestStart
from scheduler_proc.request import Request


def make_start(req: Request) -> RequestStart:
    """What the worker keeps per row: sampling state and the full fill for penalties."""
    return RequestStart(
        row=req.row,
        sampling=req.sampling,
        return_logprob=req.return_logprob,
        prompt_ids=pack_ids(req.fill_ids),
        output_len=len(req.fill_ids) - len(req.prompt_ids),
    )


def _take_starts(requests: list[Request]) -> list[RequestStart]:
    starts = []
    for req in requests:
        if req.needs_start:
            req.needs_start = False
            starts.append(make_start(req))
    return starts


def _slot_columns(assigned: list[tuple[int, np.ndarray]]) -> dict[str, bytes]:
    """(first position, slots int32) per request -> the plan's slot columns."""
    return {
        "slot_starts": pack_ids([start for start, _ in assigned]),
        "slot_lens": pack_ids([len(slots) for _, slots in assigned]),
        "slots": pack_ids(np.concatenate([s for _, s in assigned]) if assigned else []),
    }


def build_extend_plan(plan_id: int, chunks: list[tuple[Request, int, np.ndarray]]) -> ForwardPlan:
    """chunks: (request, chunk_len, slots int32 [chunk_len]), before committed_len advances.

    Clears `needs_start` on the requests it starts.
    """
    requests = [req for req, _, _ in chunks]
    input_ids, sample, next_ids = [], [], []
    for req, chunk_len, _ in chunks:
        start, end = req.committed_len, req.committed_len + chunk_len
        input_ids.extend(req.fill_ids[start:end])
        sample.append(int(end == len(req.fill_ids)))
        next_ids.append(req.fill_ids[end] if end < len(req.fill_ids) else -1)
    return ForwardPlan(
        plan_id=plan_id,
        mode="extend",
        rows=pack_ids([req.row for req in requests]),
        **_slot_columns([(req.committed_len, slots) for req, _, slots in chunks]),
        committed_lens=pack_ids([req.committed_len for req in requests]),
        extend_lens=pack_ids([chunk_len for _, chunk_len, _ in chunks]),
        input_ids=pack_ids(input_ids),
        sample=pack_ids(sample),
        next_input_ids=pack_ids(next_ids),
        starts=_take_starts(requests),
    )


def build_decode_plan(
    plan_id: int,
    requests: list[Request],
    slot_starts: list[int],
    slot_lens: list[int],
    slots: list[int],
    speculate: bool = True,
) -> ForwardPlan:
    """A decode step for `requests`, with the slot columns as `KVAllocator.grow_rows` returns
    them (per request the first new position and how many; the new slots back to back);
    speculate False: a plain step of a speculative server."""
    return ForwardPlan(
        plan_id=plan_id,
        mode="decode",
        rows=pack_ids([req.row for req in requests]),
        slot_starts=pack_ids(slot_starts),
        slot_lens=pack_ids(slot_lens),
        slots=pack_ids(slots),
        starts=_take_starts(requests),
        speculate=speculate,
    )
