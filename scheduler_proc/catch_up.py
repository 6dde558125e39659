"""The draft's catch-up after plain decode steps (adaptive speculation).

A plain step of a speculative server runs the target alone: the draft writes no KV at that
position, and its per-row state (the first draft level, the pass-back hidden) stays at the
last position it saw. An iteration drafted from there would propose for the wrong position
and attend over unwritten KV, so it would accept little exactly when adaptive speculation
probes whether to speculate again; the request would then stay plain, its draft ever staler.

So before a request speculates again it catches up: one extend step reruns the target over
the positions decoded plainly, [draft_stale_from, prefix_len), and the draft's prefill runs
over them, each position paired as always with the token after it, the last with the newest
token (which has no KV yet). Nothing is sampled: the row's committed length and newest token
stay, and the target's KV there is written again with the values a verify forward would give
it (up to rounding). Tokens are the request's own, so outputs do not depend on it. A span is
capped (CATCH_UP_MAX positions per request, the prefill budget over the batch): positions
before the cap keep no draft KV, which costs some acceptance and nothing else.

A request whose plain steps are still in flight cannot catch up yet (their tokens are not
known); the scheduler waits for their results, then plans the catch-up, then the iteration.
"""

from __future__ import annotations

import numpy as np

from aerie.codec import pack_ids
from aerie.messages import ForwardPlan
from scheduler_proc.kv_allocator import KVAllocator
from scheduler_proc.request import Request

CATCH_UP_MAX = 256  # positions per request (adaptive speculation probes at least this often)


def needs_catch_up(req: Request) -> bool:
    """Whether the draft has missed positions of req (or will, by a plain step in flight)."""
    return req.draft_stale_from is not None or req.plain_in_flight > 0


def catch_up_span(req: Request, limit: int) -> tuple[int, int]:
    """[start, end) of the positions req's catch-up reruns: the last `limit` of those the
    draft missed, up to its committed length."""
    assert req.draft_stale_from is not None
    end = req.prefix_len
    return max(req.draft_stale_from, end - limit), end


def build_catch_up_plan(
    plan_id: int, requests: list[Request], allocator: KVAllocator, budget: int
) -> ForwardPlan:
    """One extend step that catches up every request of `requests` (each stale, nothing of
    it in flight), within `budget` tokens in all; marks their drafts up to date."""
    limit = max(1, min(CATCH_UP_MAX, budget // len(requests)))
    spans, input_ids, next_ids = [], [], []
    for req in requests:
        start, end = catch_up_span(req, limit)
        tokens = req.prompt_ids + req.output_ids  # position p holds tokens[p]
        input_ids.extend(tokens[start:end])
        next_ids.append(tokens[end])  # the newest token: the draft's tail
        spans.append((start, end, allocator.slots(req.req_pool_idx, start, end)))
        req.draft_stale_from = None
    return ForwardPlan(
        plan_id=plan_id,
        mode="extend",
        rows=pack_ids([req.req_pool_idx for req in requests]),
        slot_starts=pack_ids([start for start, _, _ in spans]),
        slot_lens=pack_ids([end - start for start, end, _ in spans]),
        slots=pack_ids(np.concatenate([slots for _, _, slots in spans])),
        prefix_lens=pack_ids([start for start, _, _ in spans]),
        extend_lens=pack_ids([end - start for start, end, _ in spans]),
        input_ids=pack_ids(input_ids),
        sample=pack_ids([0] * len(requests)),
        next_input_ids=pack_ids(next_ids),
    )
