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
from aerie.plans import decode_plan, extend_plan
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


def build_extend_plan(plan_id: int, chunks: list[tuple[Request, int, np.ndarray]]) -> ForwardPlan:
    """chunks: (request, chunk_len, slots int32 [chunk_len]), before committed_len advances.

    Clears `needs_start` on the requests it starts.
    """
    requests = [req for req, _, _ in chunks]
    columns, next_ids = [], []
    for req, chunk_len, slots in chunks:
        start, end = req.committed_len, req.committed_len + chunk_len
        columns.append((req.row, start, req.fill_ids[start:end], slots, end == len(req.fill_ids)))
        next_ids.append(req.fill_ids[end] if end < len(req.fill_ids) else -1)
    return extend_plan(plan_id, columns, _take_starts(requests), next_ids)


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
    rows = [req.row for req in requests]
    return decode_plan(
        plan_id, rows, slot_starts, slot_lens, slots, _take_starts(requests), speculate
    )
