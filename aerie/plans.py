"""Columnar `ForwardPlan`s from per-request columns: the one place a plan's columns are laid
out. The scheduler builds every plan through these (`scheduler_proc/plan.py` picks the columns
from its requests); the worker's start-up warm-up and the tests that schedule by hand use them
directly. The columns' meaning is `ForwardPlan`'s (`aerie/messages.py`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from aerie.codec import pack_ids
from aerie.messages import ForwardPlan, RequestStart

# An extend chunk: (row, committed_len, its token ids, the KV slots assigned to the row up to
# the chunk's end (the chunk's own, or from position 0 for a new row reusing cached KV), whether
# it samples).
Chunk = tuple[int, int, Sequence[int], Sequence[int], bool]


def extend_plan(
    plan_id: int,
    chunks: Sequence[Chunk],
    starts: Sequence[RequestStart] = (),
    next_input_ids: Sequence[int] | None = None,
) -> ForwardPlan:
    """Each chunk runs at positions committed_len, committed_len + 1, ... and is assigned the
    slots that end at its end; next_input_ids: the token after each non-final chunk (-1)."""
    slots = [np.asarray(c[3], dtype=np.int32) for c in chunks]
    return ForwardPlan(
        plan_id=plan_id,
        mode="extend",
        rows=pack_ids([c[0] for c in chunks]),
        slot_starts=pack_ids(
            [c[1] + len(c[2]) - len(s) for c, s in zip(chunks, slots, strict=True)]
        ),
        slot_lens=pack_ids([len(s) for s in slots]),
        slots=pack_ids(np.concatenate(slots) if slots else []),
        committed_lens=pack_ids([c[1] for c in chunks]),
        extend_lens=pack_ids([len(c[2]) for c in chunks]),
        input_ids=pack_ids([t for c in chunks for t in c[2]]),
        sample=pack_ids([int(c[4]) for c in chunks]),
        next_input_ids=pack_ids(next_input_ids or [-1] * len(chunks)),
        starts=list(starts),
    )


def decode_plan(
    plan_id: int,
    rows: Sequence[int],
    slot_starts: Sequence[int] = (),
    slot_lens: Sequence[int] = (),
    slots: Sequence[int] = (),
    starts: Sequence[RequestStart] = (),
    speculate: bool = True,
) -> ForwardPlan:
    """A decode step of `rows`, each newly assigned slot_lens[i] slots from position
    slot_starts[i] on (`slots` back to back; no columns: none newly assigned). speculate False:
    a plain step of a speculative server."""
    none = [0] * len(rows)
    return ForwardPlan(
        plan_id=plan_id,
        mode="decode",
        rows=pack_ids(rows),
        slot_starts=pack_ids(slot_starts if len(slot_starts) else none),
        slot_lens=pack_ids(slot_lens if len(slot_lens) else none),
        slots=pack_ids(slots),
        starts=list(starts),
        speculate=speculate,
    )


def slot_columns(
    assigned: Sequence[tuple[int, Sequence[int]]],
) -> tuple[list[int], list[int], list[int]]:
    """(first position, slots) per row -> decode_plan's slot_starts, slot_lens, slots."""
    return (
        [start for start, _ in assigned],
        [len(s) for _, s in assigned],
        [slot for _, s in assigned for slot in s],
    )
