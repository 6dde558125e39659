"""Plans assembled from columns read back, column by column, as the worker parses them."""

from __future__ import annotations

import numpy as np

from aerie import codec
from aerie.messages import RequestStart, SamplingParams
from aerie.plans import decode_plan, extend_plan, slot_columns
from gpu_worker.step.plan_arrays import parse_plan


def test_an_extend_plan_assigns_each_chunk_its_slots_from_its_committed_length():
    start = RequestStart(3, SamplingParams(), False, codec.pack_ids([7, 8, 9]))
    chunks = [(3, 0, [7, 8], np.array([40, 41], dtype=np.int32), False), (5, 4, [2], [9], True)]
    plan = extend_plan(11, chunks, [start], next_input_ids=[9, -1])
    arrays = parse_plan(plan, max_rows=8)
    assert (plan.plan_id, plan.mode, plan.starts) == (11, "extend", [start])
    assert arrays.rows.tolist() == [3, 5] and arrays.committed_lens.tolist() == [0, 4]
    assert arrays.slot_starts.tolist() == [0, 4] and arrays.slot_lens.tolist() == [2, 1]
    assert arrays.input_ids.tolist() == [7, 8, 2] and arrays.chunk_slots.tolist() == [40, 41, 9]
    assert arrays.sample.tolist() == [False, True]
    assert arrays.next_input_ids.tolist() == [9, -1]


def test_a_decode_plan_takes_slot_columns_or_none():
    plan = decode_plan(4, [2, 6], *slot_columns([(10, [50]), (3, [60, 61])]), speculate=False)
    arrays = parse_plan(plan, max_rows=8)
    assert (plan.mode, plan.speculate) == ("decode", False)
    assert arrays.rows.tolist() == [2, 6] and arrays.slot_starts.tolist() == [10, 3]
    assert arrays.slot_lens.tolist() == [1, 2] and arrays.slots.tolist() == [50, 60, 61]
    bare = parse_plan(decode_plan(5, [1, 2, 3]), max_rows=8)  # the rows hold their slots
    assert bare.slot_lens.tolist() == [0, 0, 0] and len(bare.slots) == 0
