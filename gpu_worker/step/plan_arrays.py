"""A columnar `ForwardPlan` as numpy arrays: parsed and checked once per step, on the host.

Every plan assigns KV slots: row i's `slot_lens[i]` slots cover positions slot_starts[i] + 0, 1,
... (written into every runner's req_to_token rows). An extend plan also runs `input_ids`
[offset_i, offset_i + extend_lens[i]) of request i at positions committed_lens[i] + 0, 1, ...,
writing KV at the slots its req_to_token row holds there. A decode plan runs one token per
row, read with the committed length from the worker's per-row state on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aerie.messages import ForwardPlan
from gpu_worker.step.forward_batch import ForwardMode
from gpu_worker.step.host_batch import HostBatch, segment_offsets

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PlanArrays:
    rows: np.ndarray  # [bs] int64 request rows (indices into req_to_token)
    slot_starts: np.ndarray  # [bs] int64 position of the first slot assigned this step
    slot_lens: np.ndarray  # [bs] int64 slots assigned this step
    slots: np.ndarray  # [sum(slot_lens)] int64
    # extend only (empty for decode)
    committed_lens: np.ndarray  # [bs] int64 committed KV length before the chunk
    extend_lens: np.ndarray  # [bs] int64 tokens run per request
    input_ids: np.ndarray  # [sum(extend_lens)] int64
    sample: np.ndarray  # [bs] bool: the request produces a token this step
    next_input_ids: np.ndarray  # [bs] int64: the fill token after a non-final chunk, else -1
    chunk_slots: np.ndarray  # [sum(extend_lens)] int64: the KV slot of each chunk token

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def slot_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, position) of every assigned slot, [sum(slot_lens)] each."""
        if len(self.slots) == len(self.rows) and (self.slot_lens == 1).all():
            return self.rows, self.slot_starts  # a decode step's usual one slot per row
        rows = np.repeat(self.rows, self.slot_lens)
        return rows, np.repeat(self.slot_starts, self.slot_lens) + segment_offsets(self.slot_lens)

    def extend_batch(self) -> HostBatch:
        """The extend forward over the chunks (KV written at the slots assigned to them)."""
        within = segment_offsets(self.extend_lens)
        positions = np.repeat(self.committed_lens, self.extend_lens) + within
        return HostBatch(
            ForwardMode.EXTEND,
            self.input_ids,
            positions,
            self.chunk_slots,
            self.rows,
            self.committed_lens + self.extend_lens,
            self.extend_lens,
        )


def _chunk_slots(
    committed_lens: np.ndarray,
    extend_lens: np.ndarray,
    slot_starts: np.ndarray,
    slot_lens: np.ndarray,
    slots: np.ndarray,
) -> np.ndarray | None:
    """The slot of each chunk token, when the plan assigns every one of them (an extend plan
    must); None otherwise."""
    first = committed_lens - slot_starts  # [bs] chunk start inside each row's assignment
    if (first < 0).any() or (first + extend_lens > slot_lens).any():
        return None
    slot_offsets = np.cumsum(slot_lens) - slot_lens
    return slots[np.repeat(slot_offsets + first, extend_lens) + segment_offsets(extend_lens)]


def parse_plan(plan: ForwardPlan, max_rows: int) -> PlanArrays:
    """The plan's arrays; raises ValueError for a plan the worker cannot run."""

    def column(data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype="<i4").astype(np.int64)

    extend = plan.mode == "extend"
    rows = column(plan.rows)
    slot_starts, slot_lens, slots = (
        column(c) for c in (plan.slot_starts, plan.slot_lens, plan.slots)
    )
    bs = len(rows)
    if len(slot_starts) != bs or len(slot_lens) != bs:
        raise ValueError(f"plan {plan.plan_id}: slot columns for {len(slot_lens)} of {bs} rows")
    if int(slot_lens.sum()) != len(slots) or (slot_lens < 0).any():
        raise ValueError(f"plan {plan.plan_id}: slot_lens do not match {len(slots)} slots")
    committed_lens = extend_lens = input_ids = next_ids = chunk_slots = EMPTY
    sample = np.ones(bs, dtype=bool)
    if extend:
        committed_lens, extend_lens, input_ids, next_ids = (
            column(c)
            for c in (plan.committed_lens, plan.extend_lens, plan.input_ids, plan.next_input_ids)
        )
        sample = column(plan.sample).astype(bool)
        if any(len(c) != bs for c in (committed_lens, extend_lens, sample, next_ids)):
            raise ValueError(f"plan {plan.plan_id}: extend columns do not cover {bs} rows")
        if (extend_lens <= 0).any() or int(extend_lens.sum()) != len(input_ids):
            raise ValueError(f"plan {plan.plan_id}: extend_lens do not match {len(input_ids)} ids")
        chunk_slots = _chunk_slots(committed_lens, extend_lens, slot_starts, slot_lens, slots)
        if chunk_slots is None:
            raise ValueError(
                f"plan {plan.plan_id}: an extend chunk runs at positions without slots"
            )
    arrays = PlanArrays(
        rows,
        slot_starts,
        slot_lens,
        slots,
        committed_lens,
        extend_lens,
        input_ids,
        sample,
        next_ids,
        chunk_slots,
    )
    _check_rows(plan, rows, max_rows)
    return arrays


def _check_rows(plan: ForwardPlan, rows: np.ndarray, max_rows: int) -> None:
    if len(rows) and (rows.min() <= 0 or rows.max() > max_rows):
        bad = rows[(rows <= 0) | (rows > max_rows)][0]
        raise ValueError(f"plan {plan.plan_id}: request row {bad} is invalid")
    if len(set(rows.tolist())) != len(rows):  # (a set beats np.unique at these sizes)
        raise ValueError(f"plan {plan.plan_id}: a request row appears twice")
