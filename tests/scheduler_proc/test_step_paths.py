"""The scheduler's batched step paths: every field of the deltas built from slices of a
result, and the finish check's quick exit against the full check. (The batched paths were
checked in lockstep against the per-request code they replaced when they landed; the
allocator's batched grow has its own test in test_kv_allocator.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest

from aerie.codec import pack_ids, unpack_ids_array
from aerie.messages import (
    FinishReason,
    SamplingParams,
    TokenizedRequest,
)
from scheduler_proc.request import Request
from scheduler_proc.scheduler import PROMPT_TAIL_LEN, Scheduler
from scheduler_proc.stop import FinishChecker
from tests.scheduler_proc.fake_worker import FakeWorker, make_config


def decode_text(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_a_delta_carries_each_field_under_its_name():
    """Each field of the deltas of a speculative run with logprobs holds what its name says."""
    sched = Scheduler(make_config(), (), max_total_tokens=64, decode_alloc_len=3)
    prompt = [4, 5, 6, 7]
    msg = TokenizedRequest(
        "a",
        pack_ids(prompt),
        SamplingParams(max_new_tokens=9, stop=["zz"]),
        stream=True,
        return_logprob=True,
    )
    sched.add_request(msg)
    worker, deltas = FakeWorker(accept=lambda step, row: 2, alloc_len=3), []
    while sched.has_work() or sched.num_in_flight:
        plan = sched.next_plan()
        result = worker.run(plan)
        deltas += sched.apply_result(plan, result).deltas
    first, last = deltas[0], deltas[-1]
    assert first.rid == "a" and first.start is not None and first.start.stop == ["zz"]
    assert first.start.prompt_tail_ids == pack_ids(prompt[-PROMPT_TAIL_LEN:])
    outputs = [t for d in deltas for t in unpack_ids_array(d.token_ids).tolist()]
    logprobs = [x for d in deltas for x in np.frombuffer(d.logprobs, dtype="<f4").tolist()]
    assert len(outputs) == 9 and logprobs == [-float(t) for t in outputs]
    assert [d.completion_tokens for d in deltas] == [1, 3, 5, 7, 9]
    assert all(d.prompt_tokens == 4 for d in deltas)
    assert [d.spec_verify_ct for d in deltas] == [0, 1, 2, 3, 4]
    assert last.finish == FinishReason("length") and all(d.finish is None for d in deltas[:-1])


@pytest.mark.parametrize("seed", range(3))
def test_the_quick_finish_check_agrees_with_the_full_one(seed):
    """FinishChecker.check's quick exit (runs that end nothing) against the full check."""
    rng = random.Random(seed)
    checker = FinishChecker((3,), decode_text)
    num_quick = num_cut = 0
    for _ in range(3000):
        sampling = SamplingParams(
            max_new_tokens=rng.randint(1, 12),
            stop_token_ids=rng.sample(range(20), rng.choice([0, 1, 2])),
            ignore_eos=rng.random() < 0.5,
            stop=[decode_text(rng.sample(range(20), 2))] if rng.random() < 0.2 else [],
        )
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 8))]
        req = Request("r", prompt, sampling, context_length=rng.choice([None, 12, 16]))
        req.output_ids = [rng.randrange(20) for _ in range(rng.randint(0, 10))]
        new_ids = [rng.randrange(20) for _ in range(rng.randint(1, 5))]
        got = checker.check(req, new_ids)
        assert got == checker._check_run(req, new_ids)
        num_cut += got[1] is not None or got[0] < len(new_ids)
        num_quick += got == (len(new_ids), None)
    assert num_quick > 300 and num_cut > 300
