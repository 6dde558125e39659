"""A `ForwardPlan` as numpy arrays: parsed and checked once per step, on the host.

Request i runs `input_ids` [offset_i, offset_i + extend_lens[i]) at positions
prefix_lens[i] + 0, 1, ...; its assigned KV slots (`slot_lens[i]` of them, the speculative
headroom included) cover positions prefix_lens[i] + 0, 1, ...; the tokens run write KV at the
first extend_lens[i] of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from aerie.messages import ForwardPlan
from gpu_worker.forward_batch import ForwardMode
from gpu_worker.host_batch import HostBatch, segment_offsets


@dataclass(frozen=True)
class PlanArrays:
    rows: np.ndarray  # [bs] int64 request rows (req_pool_idx)
    prefix_lens: np.ndarray  # [bs] int64 committed KV length before the step
    input_ids: np.ndarray  # [num_tokens] int64
    extend_lens: np.ndarray  # [bs] int64 tokens run per request
    slots: np.ndarray  # [sum(slot_lens)] int64 KV slots assigned this step
    slot_lens: np.ndarray  # [bs] int64
    sample: np.ndarray  # [bs] bool: the request produces a token this step
    next_input_ids: np.ndarray  # [bs] int64: the fill token after a non-final chunk, else -1

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def host_batch(self, mode: ForwardMode) -> HostBatch:
        """The forward over the tokens run (KV written at the first slots of each request)."""
        slot_starts = np.cumsum(self.slot_lens) - self.slot_lens
        within = segment_offsets(self.extend_lens)
        out_cache_loc = self.slots[np.repeat(slot_starts, self.extend_lens) + within]
        positions = np.repeat(self.prefix_lens, self.extend_lens) + within
        return HostBatch(
            mode, self.input_ids, positions, out_cache_loc, self.rows,
            self.prefix_lens + self.extend_lens, self.extend_lens,
        )  # fmt: skip


def parse_plan(plan: ForwardPlan, max_rows: int) -> PlanArrays:
    """The plan's arrays; raises ValueError for a plan the worker cannot run."""
    requests = plan.requests
    ids = [np.frombuffer(r.input_ids, dtype="<i4") for r in requests]
    slots = [np.frombuffer(r.out_slots, dtype="<i4") for r in requests]
    arrays = PlanArrays(
        rows=np.array([r.req_pool_idx for r in requests], dtype=np.int64),
        prefix_lens=np.array([r.prefix_len for r in requests], dtype=np.int64),
        input_ids=np.concatenate(ids).astype(np.int64),
        extend_lens=np.array([len(x) for x in ids], dtype=np.int64),
        slots=np.concatenate(slots).astype(np.int64),
        slot_lens=np.array([len(x) for x in slots], dtype=np.int64),
        sample=np.array([r.sample for r in requests], dtype=bool),
        next_input_ids=np.array([r.next_input_id for r in requests], dtype=np.int64),
    )
    _check(plan, arrays, max_rows)
    return arrays


def _check(plan: ForwardPlan, a: PlanArrays, max_rows: int) -> None:
    bad = np.flatnonzero((a.extend_lens == 0) | (a.slot_lens < a.extend_lens))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{plan.requests[i].rid}: {a.extend_lens[i]} input ids, "
                         f"{a.slot_lens[i]} out slots")  # fmt: skip
    if plan.mode == "decode" and (a.extend_lens != 1).any():
        i = int(np.flatnonzero(a.extend_lens != 1)[0])
        raise ValueError(f"{plan.requests[i].rid}: a decode step runs one token, "
                         f"got {a.extend_lens[i]}")  # fmt: skip
    bad = np.flatnonzero((a.rows <= 0) | (a.rows > max_rows))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{plan.requests[i].rid}: req_pool_idx {a.rows[i]} is invalid")
