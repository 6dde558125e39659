"""The scheduler's batched step paths (decode KV grown for all rows in one allocator call, the
finish check's quick exit, delta bytes sliced from the result, one length limit per request)
against the per-request path they replaced, kept here as `ReferenceScheduler`: on random
mixes of stop ids, EOS, stop strings, max_new_tokens, context limits, logprobs, speculative
runs, aborts and retractions, both must send the same plans, the same deltas and leave the
allocator in the same state (free-list order included) after every step."""

from __future__ import annotations

import dataclasses
import random
from collections import deque

import numpy as np
import pytest

from aerie.codec import pack_floats, pack_ids, unpack_ids_array
from aerie.messages import (
    DetokenizeStart,
    FinishReason,
    ForwardPlan,
    RequestDelta,
    SamplingParams,
    StepResult,
    TokenDeltas,
    TokenizedRequest,
)
from scheduler_proc.plan import build_decode_plan
from scheduler_proc.policy import DecodeDecision, NewTokenEstimate, SchedulePolicy
from scheduler_proc.request import ReqState, Request
from scheduler_proc.scheduler import PROMPT_TAIL_LEN, Scheduler
from scheduler_proc.stop import FinishChecker
from tests.scheduler_proc.fake_worker import VOCAB, FakeWorker, make_config
from tests.scheduler_proc.test_kv_allocator import allocator_state


def decode_text(ids: list[int]) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


class ReferencePolicy(SchedulePolicy):
    """Per-request decisions: the context length and max_new_tokens checked apart, one
    allocator call per request."""

    def __init__(self, policy: SchedulePolicy, context_length: int | None) -> None:
        super().__init__(policy.chunked_prefill_size, policy.decode_alloc_len,
                         policy.max_running_requests, policy.max_in_flight)  # fmt: skip
        self.context_length = context_length

    def finishes_in_flight(self, req: Request) -> bool:
        produced = req.seq_len + req.samples_in_flight
        if self.context_length is not None and produced >= self.context_length:
            return True
        return len(req.output_ids) + req.samples_in_flight >= req.sampling.max_new_tokens

    def is_decoding(self, req: Request) -> bool:
        return not req.is_prefilling and not self.finishes_in_flight(req)

    def decode_pages_needed(self, decoding, allocator) -> int:
        return sum(allocator.pages_needed(r.req_pool_idx, self.decode_end(r)) for r in decoding)

    def plan_decode(self, running, allocator) -> DecodeDecision:
        decoding = {r for r in running if self.is_decoding(r)}
        need = self.decode_pages_needed(decoding, allocator)
        free_pages = allocator.num_free_pages
        kept = list(running)
        retracted: list[Request] = []
        while need > free_pages:
            req = self._pick_victim(kept, decoding)
            if req is None:
                break
            kept.remove(req)
            if req in decoding:
                decoding.remove(req)
                need -= allocator.pages_needed(req.req_pool_idx, self.decode_end(req))
            free_pages += allocator.num_held_pages(req.req_pool_idx)
            retracted.append(req)
        batch = [r for r in kept if r in decoding]
        return DecodeDecision(batch=batch, retracted=retracted, fits=need <= free_pages)


class ReferenceScheduler(Scheduler):
    """The per-request step path: a grow per decoding row, numpy slices per result entry, the
    full finish check for every run, every delta's ids packed from output_ids."""

    def __init__(self, config, *args, **kwargs) -> None:
        super().__init__(config, *args, **kwargs)
        self.policy = ReferencePolicy(self.policy, config.model.context_length)

    def _plan_decode(self):
        decision = self.policy.plan_decode(self.running, self.allocator)
        if (decision.retracted or not decision.fits) and self._in_flight:
            return None
        self.new_tokens.on_decode_step()
        if decision.retracted:
            self.new_tokens.on_retract(self.running)
        for req in decision.retracted:
            self._retract(req)
        batch = []
        for req in decision.batch:
            start = self.allocator.allocated_len(req.req_pool_idx)
            slots = self.allocator.grow(req.req_pool_idx, max(start, self.policy.decode_end(req)))
            assert slots is not None
            batch.append((req, start, slots))
        plan = build_decode_plan(self._take_plan_id(), batch)
        return plan, decision.batch, [True] * len(batch)

    def apply_result(self, plan: ForwardPlan, result: StepResult) -> TokenDeltas | None:
        assert plan is self._in_flight[0][0] and result.plan_id == plan.plan_id
        _, requests, samples = self._in_flight.popleft()
        num_tokens = unpack_ids_array(result.num_tokens)
        token_ids = unpack_ids_array(result.token_ids)
        logprobs = np.frombuffer(result.logprobs, dtype="<f4") if result.logprobs else None
        num_verify = (unpack_ids_array(result.num_verify) if result.num_verify
                      else np.zeros(len(requests), dtype=np.int32))  # fmt: skip
        ends = np.cumsum(num_tokens)
        for i, req in enumerate(requests):
            req.in_flight -= 1
            req.samples_in_flight -= samples[i]
            req.decodes_in_flight -= plan.mode == "decode"
            if req.state == ReqState.FINISHED:
                if req.in_flight == 0:
                    self._release(req)
                continue
            start, end = int(ends[i] - num_tokens[i]), int(ends[i])
            new_logprobs = None if logprobs is None else logprobs[start:end]
            self._reference_entry(req, plan.mode, int(num_verify[i]), token_ids[start:end],
                                  new_logprobs)  # fmt: skip
        return self.take_deltas()

    def _reference_entry(self, req, mode, num_verify, new_ids, new_logprobs) -> None:
        req.spec_verify_ct += num_verify
        if mode == "decode":
            req.prefix_len += len(new_ids)
            if num_verify > 0:
                self._count_accepts(len(new_ids), num_verify)
        if len(new_ids) == 0:
            return
        num_keep, finish = self._reference_check(req, new_ids)
        req.output_ids.extend(new_ids[:num_keep].tolist())
        if req.return_logprob:
            if new_logprobs is None:
                req.output_logprobs.extend([float("nan")] * num_keep)
            else:
                req.output_logprobs.extend(new_logprobs[:num_keep].tolist())
        if finish is not None:
            self._finish(req, finish)
            return
        if mode == "decode":
            keep = req.prefix_len + self.policy.decode_alloc_len * req.decodes_in_flight
            self.allocator.shrink(req.req_pool_idx, keep)
        self._emit(req)

    def _reference_check(self, req, new_ids: np.ndarray):
        checker, context_length = self.finish_checker, self.policy.context_length
        sampling = req.sampling
        limit = min(len(new_ids), max(sampling.max_new_tokens - len(req.output_ids), 0))
        if context_length is not None:
            limit = min(limit, max(context_length - req.seq_len, 0))
        num_keep, finish = limit, None
        stop_ids = checker.stop_ids(req)
        if stop_ids and limit:
            hit = next((i for i, t in enumerate(new_ids[:limit].tolist()) if t in stop_ids), None)
            if hit is not None:
                num_keep, finish = hit + 1, FinishReason("stop", matched=int(new_ids[hit]))
        if sampling.stop and checker.decode_tokens is not None and num_keep:
            found = checker._find_stop_string(req, new_ids[:num_keep].tolist())
            if found is not None:
                num_keep, finish = found[0], FinishReason("stop", matched=found[1])
        if finish is None and len(req.output_ids) + num_keep >= sampling.max_new_tokens:
            finish = FinishReason("length")
        if finish is None and context_length is not None:
            if req.seq_len + num_keep >= context_length:
                finish = FinishReason("length")
        return num_keep, finish

    def _emit(self, req: Request, packed_unsent: bytes | None = None) -> None:
        if req.num_sent == len(req.output_ids) and req.finish is None:
            return
        start = None
        if not req.detok_started:
            req.detok_started = True
            start = DetokenizeStart(
                skip_special_tokens=req.sampling.skip_special_tokens,
                stop=list(req.sampling.stop),
                stream=req.stream,
                prompt_tail_ids=pack_ids(req.prompt_ids[-PROMPT_TAIL_LEN:]),
            )
        self._deltas.append(RequestDelta(
            rid=req.rid,
            token_ids=pack_ids(req.output_ids[req.num_sent :]),
            logprobs=pack_floats(req.output_logprobs[req.num_sent :]) if req.return_logprob
            else b"",
            finish=req.finish,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            spec_verify_ct=req.spec_verify_ct,
            start=start,
        ))  # fmt: skip
        req.num_sent = len(req.output_ids)


def random_requests(rng: random.Random, num: int, stop_strings: bool) -> list[TokenizedRequest]:
    requests = []
    for i in range(num):
        sampling = SamplingParams(
            max_new_tokens=rng.choice([1, 2, 3, 8, 16, 30, 60]),
            stop_token_ids=rng.sample(range(VOCAB), rng.choice([0, 0, 1, 3])),
            ignore_eos=rng.random() < 0.5,
            stop=[decode_text(rng.sample(range(26), rng.randint(1, 2)))]
            if stop_strings and rng.random() < 0.4 else [],
        )  # fmt: skip
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 24))]
        requests.append(TokenizedRequest(f"r{i}", pack_ids(prompt), sampling, stream=True,
                                         return_logprob=rng.random() < 0.5))  # fmt: skip
    return requests


def run_both(seed: int, page_size: int, alloc_len: int, overlap: bool, stop_strings: bool):
    """Drive the scheduler and the reference through the same random run, comparing every
    plan, result, delta and the allocators after each step. Returns what happened."""
    rng = random.Random(seed)
    config = make_config(page_size=page_size, max_running=6, chunk=16, context_length=40,
                         overlap=overlap)  # fmt: skip
    config = config.replace(scheduler={"schedule_conservativeness": 0.0})
    eos = (rng.randrange(VOCAB),)
    decode = decode_text if stop_strings else None
    pair = [cls(config, eos, max_total_tokens=112, decode_tokens=decode, decode_alloc_len=alloc_len)
            for cls in (Scheduler, ReferenceScheduler)]  # fmt: skip
    for sched in pair:
        sched.new_tokens = NewTokenEstimate(0.0)  # admit on free KV alone: retractions happen
    fast, ref = pair
    workers = [FakeWorker(accept=lambda step, row: 1 + (step * 7 + row * 3) % alloc_len,
                          alloc_len=alloc_len) for _ in pair]  # fmt: skip
    pending = deque(random_requests(rng, 40, stop_strings))
    rids = [msg.rid for msg in pending]
    max_new = {msg.rid: msg.sampling.max_new_tokens for msg in pending}
    in_flight: deque = deque()
    finishes: list[str] = []  # how each request ended

    def same_deltas(deltas_fast, deltas_ref) -> None:
        assert deltas_fast == deltas_ref
        for delta in deltas_fast.deltas if deltas_fast else []:
            assert isinstance(delta.token_ids, bytes)
            finish = delta.finish
            if finish is None:
                continue
            if finish.type == "stop":
                finishes.append("stop_string" if isinstance(finish.matched, str) else "stop_id")
            elif finish.type == "length" and delta.completion_tokens < max_new[delta.rid]:
                finishes.append("context_length")
            else:
                finishes.append(finish.type)

    for _ in range(3000):
        if not (pending or fast.has_work() or in_flight):
            break
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                msg = pending.popleft()
                fast.add_request(msg)
                ref.add_request(msg)
        if rng.random() < 0.06:  # often while a plan in flight holds it
            rid = rng.choice(rids)
            fast.abort(rid)
            ref.abort(rid)
        same_deltas(fast.take_deltas(), ref.take_deltas())
        while fast.can_plan() and fast.has_work():
            plans = [sched.next_plan() for sched in pair]
            assert plans[0] == plans[1]
            if plans[0] is None:
                break
            results = [worker.run(plan) for worker, plan in zip(workers, plans, strict=True)]
            assert results[0] == results[1]
            if rng.random() < 0.2:  # no logprobs from the worker: NaN for those who want them
                results = [dataclasses.replace(r, logprobs=b"") for r in results]
            in_flight.append((plans, results))
        assert (ref.can_plan(), ref.has_work()) == (fast.can_plan(), fast.has_work())
        if in_flight:
            plans, results = in_flight.popleft()
            same_deltas(
                *[s.apply_result(p, r) for s, p, r in zip(pair, plans, results, strict=True)]
            )
        assert allocator_state(fast.allocator) == allocator_state(ref.allocator)
        assert fast.stats() == ref.stats()
        assert [r.rid for r in fast.running] == [r.rid for r in ref.running]
        assert [r.rid for r in fast.waiting] == [r.rid for r in ref.waiting]
    else:
        raise AssertionError("the run did not end")
    assert fast.allocator.is_whole()
    return finishes, fast.stats()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("page_size,alloc_len", [(1, 1), (4, 1), (1, 3), (4, 3)])
def test_batched_step_paths_match_the_per_request_path(page_size, alloc_len, overlap):
    kinds = dict.fromkeys(["stop_id", "stop_string", "length", "context_length", "abort"], 0)
    retractions = 0
    for seed in range(4):
        finishes, stats = run_both(seed, page_size, alloc_len, overlap, stop_strings=seed % 2 == 1)
        retractions += stats.num_retractions
        for kind in finishes:
            kinds[kind] += 1
    assert min(kinds.values()) >= 3, kinds  # the runs exercised every way to finish
    assert retractions > 0


def test_a_delta_carries_each_field_under_its_name():
    """Each field of the deltas of a speculative run with logprobs holds what its name says."""
    sched = Scheduler(make_config(), (), max_total_tokens=64, decode_alloc_len=3)
    prompt = [4, 5, 6, 7]
    msg = TokenizedRequest("a", pack_ids(prompt), SamplingParams(max_new_tokens=9, stop=["zz"]),
                           stream=True, return_logprob=True)  # fmt: skip
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
        )  # fmt: skip
        prompt = [rng.randrange(20) for _ in range(rng.randint(1, 8))]
        req = Request("r", prompt, sampling, context_length=rng.choice([None, 12, 16]))
        req.output_ids = [rng.randrange(20) for _ in range(rng.randint(0, 10))]
        new_ids = [rng.randrange(20) for _ in range(rng.randint(1, 5))]
        got = checker.check(req, new_ids)
        assert got == checker._check_run(req, new_ids)
        num_cut += got[1] is not None or got[0] < len(new_ids)
        num_quick += got == (len(new_ids), None)
    assert num_quick > 300 and num_cut > 300
