"""Turn a chosen batch into the `ForwardPlan` message the GPU worker runs. Pure.

Extend: each request runs `fill_ids[prefix_len : prefix_len + chunk_len]` at positions
prefix_len, prefix_len + 1, ... and writes KV at `out_slots`; it samples on its final chunk only.
Decode: each request runs its newest output token at position prefix_len; `out_slots` covers
[prefix_len, prefix_len + decode_alloc_len), the headroom speculation writes into.
A request carries a `RequestStart` the first time it runs on its row (again after retraction).
"""

from __future__ import annotations

import numpy as np

from aerie.codec import pack_ids
from aerie.messages import ForwardPlan, PlanRequest, RequestStart
from scheduler_proc.request import Request


def make_start(req: Request) -> RequestStart:
    """What the worker keeps per row: sampling state and the full fill for penalties."""
    return RequestStart(
        sampling=req.sampling,
        return_logprob=req.return_logprob,
        prompt_ids=pack_ids(req.fill_ids),
        output_len=len(req.fill_ids) - len(req.prompt_ids),
    )


def _take_start(req: Request) -> RequestStart | None:
    if not req.needs_start:
        return None
    req.needs_start = False
    return make_start(req)


def build_extend_plan(plan_id: int, chunks: list[tuple[Request, int, np.ndarray]]) -> ForwardPlan:
    """chunks: (request, chunk_len, out_slots int32 [chunk_len]), before prefix_len advances.

    Clears `needs_start` on the requests it starts.
    """
    requests = []
    for req, chunk_len, slots in chunks:
        start, end = req.prefix_len, req.prefix_len + chunk_len
        requests.append(
            PlanRequest(
                rid=req.rid,
                req_pool_idx=req.req_pool_idx,
                prefix_len=start,
                input_ids=pack_ids(req.fill_ids[start:end]),
                out_slots=pack_ids(slots),
                sample=end == len(req.fill_ids),
                start=_take_start(req),
                next_input_id=req.fill_ids[end] if end < len(req.fill_ids) else -1,
            )
        )
    return ForwardPlan(plan_id=plan_id, mode="extend", requests=requests)


def build_decode_plan(plan_id: int, batch: list[tuple[Request, np.ndarray]]) -> ForwardPlan:
    """batch: (request, out_slots int32 [decode_alloc_len]) for decoding requests."""
    requests = [
        PlanRequest(
            rid=req.rid,
            req_pool_idx=req.req_pool_idx,
            prefix_len=req.prefix_len,
            input_ids=pack_ids(req.output_ids[-1:]),
            out_slots=pack_ids(slots),
            sample=True,
            start=_take_start(req),
        )
        for req, slots in batch
    ]
    return ForwardPlan(plan_id=plan_id, mode="decode", requests=requests)
