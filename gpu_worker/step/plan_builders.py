"""Columnar `ForwardPlan`s from per-request lists: the start-up warm-up's plans, and worker tests
that schedule by hand."""

from __future__ import annotations

from collections.abc import Sequence

from aerie.codec import pack_ids
from aerie.messages import ForwardPlan, RequestStart


def extend_plan(
    plan_id: int,
    chunks: Sequence[tuple[int, int, Sequence[int], Sequence[int], bool]],
    starts: Sequence[RequestStart] = (),
    next_input_ids: Sequence[int] | None = None,
) -> ForwardPlan:
    """chunks: (row, committed_len, chunk ids, their slots, sample) per request."""
    return ForwardPlan(
        plan_id=plan_id,
        mode="extend",
        rows=pack_ids([c[0] for c in chunks]),
        slot_starts=pack_ids([c[1] for c in chunks]),
        slot_lens=pack_ids([len(c[3]) for c in chunks]),
        slots=pack_ids([s for c in chunks for s in c[3]]),
        committed_lens=pack_ids([c[1] for c in chunks]),
        extend_lens=pack_ids([len(c[2]) for c in chunks]),
        input_ids=pack_ids([t for c in chunks for t in c[2]]),
        sample=pack_ids([int(c[4]) for c in chunks]),
        next_input_ids=pack_ids(next_input_ids or [-1] * len(chunks)),
        starts=list(starts),
    )


def decode_plan(
    plan_id: int, rows: Sequence[int], new_slots: Sequence[tuple[int, Sequence[int]]] = ()
) -> ForwardPlan:
    """rows: the decoding rows; new_slots: (first position, slots) per row newly assigned
    (empty: none, the rows already hold slots for the step)."""
    assigned = list(new_slots) or [(0, [])] * len(rows)
    return ForwardPlan(
        plan_id=plan_id,
        mode="decode",
        rows=pack_ids(rows),
        slot_starts=pack_ids([start for start, _ in assigned]),
        slot_lens=pack_ids([len(slots) for _, slots in assigned]),
        slots=pack_ids([s for _, slots in assigned for s in slots]),
    )
