"""The scheduler's batched step paths: every column of the step outputs built from slices of
a result, and the finish check's quick exit against the full check. (The batched paths were
checked in lockstep against the per-request code they replaced when they landed; the
allocator's batched grow has its own test in test_kv_allocator.py.)"""

from __future__ import annotations

import random

import pytest

from aerie.codec import pack_ids
from aerie.messages import (
    FinishReason,
    SamplingParams,
    TokenizedRequest,
)
from aerie.outputs import read_outputs
from scheduler_proc.request import Request
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.stop import FinishChecker
from tests.scheduler_proc.fake_worker import FakeWorker, make_config


def decode_text(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_each_column_of_the_step_outputs_holds_what_its_name_says():
    """A speculative run of two requests of two frontends, one with logprobs: each step's
    outputs reach the request's own frontend, and every column holds what its name says."""
    sched = Scheduler(make_config(), (), max_total_tokens=64, decode_alloc_len=3)
    sampling = SamplingParams(max_new_tokens=9, stop=["zz"])
    sched.add_request(TokenizedRequest("a", pack_ids([4, 5, 6, 7]), sampling, return_logprob=True))
    sched.add_request(TokenizedRequest("b", pack_ids([1, 2]), sampling, frontend=1))
    worker, messages = FakeWorker(accept=lambda step, row: 2, alloc_len=3), []
    while sched.has_work() or sched.num_in_flight:
        plan = sched.next_plan()
        messages += sched.apply_result(plan, worker.run(plan))
    outputs = {"a": [], "b": []}
    for message in messages:
        assert message.rids == [("a", "b")[message.frontend]]
        assert bool(message.logprobs) == (message.frontend == 0)  # only a asked
        outputs[message.rids[0]] += list(read_outputs(message))
    for rid, outs in outputs.items():
        ids = [t for out in outs for t in out.token_ids]
        assert len(ids) == 9 and [len(out.token_ids) for out in outs] == [1, 2, 2, 2, 2]
        assert [out.spec_verify_ct for out in outs] == [0, 1, 2, 3, 4]
        assert all(out.cached_tokens == 0 for out in outs)
        assert outs[-1].finish == FinishReason("length")
        assert all(out.finish is None for out in outs[:-1])
        logprobs = [x for out in outs for x in out.logprobs]
        assert logprobs == ([-float(t) for t in ids] if rid == "a" else [])


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
