"""A columnar `ForwardPlan` as numpy arrays: parsed and checked once per step, on the host.

Every plan assigns KV slots: row i's `slot_lens[i]` slots cover positions slot_starts[i] + 0, 1,
... (written into every runner's req_to_token rows). An extend plan also runs `input_ids`
[offset_i, offset_i + extend_lens[i]) of request i at positions prefix_lens[i] + 0, 1, ...,
writing KV at the slots its req_to_token row holds there. A decode plan runs one token per
row, read with the committed length from the worker's per-row state on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aerie.messages import ForwardPlan
from gpu_worker.forward_batch import ForwardMode
from gpu_worker.host_batch import HostBatch, segment_offsets

EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class PlanArrays:
    rows: np.ndarray  # [bs] int64 request rows (req_pool_idx)
    slot_starts: np.ndarray  # [bs] int64 position of the first slot assigned this step
    slot_lens: np.ndarray  # [bs] int64 slots assigned this step
    slots: np.ndarray  # [sum(slot_lens)] int64
    # extend only (empty for decode)
    prefix_lens: np.ndarray  # [bs] int64 committed KV length before the chunk
    extend_lens: np.ndarray  # [bs] int64 tokens run per request
    input_ids: np.ndarray  # [sum(extend_lens)] int64
    sample: np.ndarray  # [bs] bool: the request produces a token this step
    next_input_ids: np.ndarray  # [bs] int64: the fill token after a non-final chunk, else -1

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def slot_positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, position) of every assigned slot, [sum(slot_lens)] each."""
        rows = np.repeat(self.rows, self.slot_lens)
        return rows, np.repeat(self.slot_starts, self.slot_lens) + segment_offsets(self.slot_lens)

    def extend_batch(self) -> HostBatch:
        """The extend forward over the chunks (KV written at the slots assigned to them)."""
        index = self.chunk_slot_indices()
        assert index is not None, "parse_plan checks that extend chunks have their slots"
        out_cache_loc = self.slots[index]
        within = segment_offsets(self.extend_lens)
        positions = np.repeat(self.prefix_lens, self.extend_lens) + within
        return HostBatch(
            ForwardMode.EXTEND, self.input_ids, positions, out_cache_loc, self.rows,
            self.prefix_lens + self.extend_lens, self.extend_lens,
        )  # fmt: skip

    def chunk_slot_indices(self) -> np.ndarray | None:
        """Where each chunk token's slot sits in `slots`, when this plan assigns every one of
        them (an extend plan must); None otherwise."""
        slot_offsets = np.cumsum(self.slot_lens) - self.slot_lens
        first = self.prefix_lens - self.slot_starts  # [bs] chunk start inside the assignment
        if (first < 0).any() or (first + self.extend_lens > self.slot_lens).any():
            return None
        within = segment_offsets(self.extend_lens)
        return np.repeat(slot_offsets + first, self.extend_lens) + within


def parse_plan(plan: ForwardPlan, max_rows: int) -> PlanArrays:
    """The plan's arrays; raises ValueError for a plan the worker cannot run."""

    def column(data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype="<i4").astype(np.int64)

    extend = plan.mode == "extend"
    rows = column(plan.rows)
    arrays = PlanArrays(
        rows=rows,
        slot_starts=column(plan.slot_starts),
        slot_lens=column(plan.slot_lens),
        slots=column(plan.slots),
        prefix_lens=column(plan.prefix_lens) if extend else EMPTY,
        extend_lens=column(plan.extend_lens) if extend else EMPTY,
        input_ids=column(plan.input_ids) if extend else EMPTY,
        sample=column(plan.sample).astype(bool) if extend else np.ones(len(rows), dtype=bool),
        next_input_ids=column(plan.next_input_ids) if extend else EMPTY,
    )
    _check(plan, arrays, max_rows)
    return arrays


def _check(plan: ForwardPlan, a: PlanArrays, max_rows: int) -> None:
    bs = a.batch_size
    if len(a.slot_starts) != bs or len(a.slot_lens) != bs:
        raise ValueError(f"plan {plan.plan_id}: slot columns for {len(a.slot_lens)} of {bs} rows")
    if int(a.slot_lens.sum()) != len(a.slots) or (a.slot_lens < 0).any():
        raise ValueError(f"plan {plan.plan_id}: slot_lens do not match {len(a.slots)} slots")
    bad = np.flatnonzero((a.rows <= 0) | (a.rows > max_rows))
    if bad.size:
        raise ValueError(f"plan {plan.plan_id}: request row {a.rows[bad[0]]} is invalid")
    if len(np.unique(a.rows)) != bs:
        raise ValueError(f"plan {plan.plan_id}: a request row appears twice")
    if plan.mode != "extend":
        return
    columns = (a.prefix_lens, a.extend_lens, a.sample, a.next_input_ids)
    if any(len(c) != bs for c in columns):
        raise ValueError(f"plan {plan.plan_id}: extend columns do not cover {bs} rows")
    if (a.extend_lens <= 0).any() or int(a.extend_lens.sum()) != len(a.input_ids):
        raise ValueError(f"plan {plan.plan_id}: extend_lens do not match {len(a.input_ids)} ids")
    if a.chunk_slot_indices() is None:
        raise ValueError(f"plan {plan.plan_id}: an extend chunk runs at positions without slots")
