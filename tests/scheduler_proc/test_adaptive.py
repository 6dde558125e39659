"""Adaptive speculation's choice (`scheduler_proc.adaptive`) and its step costs, alone and
inside the scheduler with the fake worker."""

from __future__ import annotations

import pytest

from aerie.config import AerieConfig
from aerie.messages import SamplingParams
from aerie.resolve import ConfigError, _validate
from aerie.step_costs import StepCosts
from scheduler_proc.adaptive import (
    FIRST_PROBE,
    HYSTERESIS,
    LONG_RUN,
    MAX_PROBE,
    PRIOR_ITERATIONS,
    PROBE_ITERATIONS,
    AdaptiveSpeculation,
    KindStats,
    RequestEstimate,
    kind,
    samples,
)
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import outputs_of
from tests.scheduler_proc.fake_worker import Collector, FakeWorker, make_request, reference_output

G, S = (False,), (True, 0.7, 1.0, -1, 0.0)  # request kinds: greedy, sampled at 0.7


def settled(mean: float) -> KindStats:
    """A kind observed so often, with so little spread, that estimates carry no error: the
    choice is the mean against the break-even alone."""
    return KindStats(count=10**9, mean=mean, variance=0.0)


def known(mean: float) -> RequestEstimate:
    """A request observed so long that its estimate is its mean, settled."""
    return RequestEstimate(mean, prior=0, count=10**9)


def misses(policy: AdaptiveSpeculation, rid: str, n: int) -> None:
    """n iterations of rid that emitted one token each (the draft missed)."""
    for _ in range(n):
        policy.observe(rid, 1)


def costs(break_even: dict[int, float], sampled_factor: float = 1.0) -> StepCosts:
    """Plain steps of 1 ms; iterations of break_even[bucket] ms (sampled: times the factor)."""
    buckets = tuple(sorted(break_even))
    spec = tuple(break_even[b] for b in buckets)
    ones = (1.0,) * len(buckets)
    sampled = tuple(t * sampled_factor for t in spec)
    return StepCosts(
        buckets, {"greedy": ones, "sampled": ones}, {"greedy": spec, "sampled": sampled}
    )


def test_break_even_is_the_buckets_cost_ratio():
    c = costs({1: 2.0, 4: 3.0, 8: 5.0}, sampled_factor=1.5)
    assert c.break_even(1, False) == 2.0
    assert c.break_even(2, False) == 3.0  # the smallest bucket that holds the batch
    assert c.break_even(8, False) == 5.0
    assert c.break_even(100, False) == 5.0  # beyond the graphs: the last bucket's ratio
    assert c.break_even(3, True) == 4.5
    assert StepCosts.from_json(c.to_json()) == c


@pytest.mark.parametrize(
    "text, says",
    [
        ("not json", "JSONDecodeError"),
        ('{"buckets": [1], "plain_ms": {"greedy": [1]}}', "KeyError"),
        (
            '{"buckets": [2, 1], "plain_ms": {"greedy": [1, 1], "sampled": [1, 1]}, '
            '"speculative_ms": {"greedy": [1, 1], "sampled": [1, 1]}}',
            "increasing",
        ),
        (
            '{"buckets": [1], "plain_ms": {"greedy": [0], "sampled": [1]}, '
            '"speculative_ms": {"greedy": [1], "sampled": [1]}}',
            "positive",
        ),
    ],
)
def test_bad_step_costs_are_refused_at_start_up_with_the_reason(text, says):
    config = AerieConfig().replace(speculative={"speculative_step_costs": text})
    with pytest.raises(ConfigError, match=says):
        _validate(config)


def test_before_any_observation_every_step_speculates():
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    first = policy.choose(["a"], [G])
    assert first.speculate and first.expected is None  # speculate to learn


def test_a_request_whose_draft_misses_decodes_plainly_and_probes_less_and_less():
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    misses(policy, "a", 16)
    choices = [policy.choose(["a"], [G]) for _ in range(4 * MAX_PROBE)]
    assert all(c.speculate == c.probe for c in choices)  # plain but for the probes
    runs = "".join("s" if c.speculate else "p" for c in choices).split("s" * PROBE_ITERATIONS)
    plain_runs = [len(run) for run in runs[:-1]]
    assert plain_runs[:4] == [FIRST_PROBE, 2 * FIRST_PROBE, 4 * FIRST_PROBE, 8 * FIRST_PROBE]
    assert set(plain_runs[4:]) == {MAX_PROBE}
    assert len(plain_runs) >= 6


def test_a_probe_that_finds_agreement_switches_back():
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    misses(policy, "a", 16)
    while not policy.choose(["a"], [G]).probe:
        pass
    agreeing = 0
    while not policy.choose(["a"], [G]).speculate or policy.last.probe:
        policy.observe("a", 4)  # the probes find the draft agreeing in full
        agreeing += 1
    # After k probes of 4: a's estimate (16 + 4k) / (16 + k) and the kind's 16 1s and k 4s,
    # spread (8 x 1.5^2 + (16 + k) variance) / (24 + k), give or take sqrt(spread / (16 + k)).
    # k = 2: 1.333 + sqrt(1.31 / 18) = 1.60 < 2; k = 3: 1.474 + sqrt(1.51 / 19) = 1.76 < 2;
    # k = 4: 1.6 + sqrt(1.67 / 20) = 1.89 < 2; k = 5: 1.714 + sqrt(1.80 / 21) = 2.01 >= 2.
    assert agreeing == 5 and policy.probe_interval == FIRST_PROBE


def test_a_servers_first_request_is_not_judged_by_its_first_misses():
    """The first request of a server (the shipped EAGLE-3 draft on the default model, an
    MT-bench prompt, T = 0, CPU float32: its first 40 accept lengths, mean 1.5) against the H200's
    break-even of 1.53: its first iterations missed, and the kind's mean started there, which
    sent this request and every later one to plain decoding. Now it keeps speculating (it is
    near the break-even), and the next request starts speculating from its own first step."""
    trace = [int(c) for c in "1112111313121221111111321211113113111111"]
    policy = AdaptiveSpeculation(costs({1: 1.53}))
    for accept in trace:
        assert policy.choose(["r0"], [G]).speculate
        policy.observe("r0", accept)
    policy.forget("r0")
    first = policy.choose(["r1"], [G])
    assert first.speculate and first.expected == pytest.approx(policy.kinds[G].mean)
    assert first.expected + first.error >= 1.53 > first.expected


def test_many_requests_follow_their_mean_and_one_follows_its_own_evidence():
    """The standard error shrinks with the batch: 64 new requests of a kind accepting 1.4 on
    average decode plainly against a break-even of 1.53, where one new request still tries;
    a request whose own iterations keep missing stops trying."""
    policy = AdaptiveSpeculation(costs({1: 1.53, 64: 1.53}))
    policy.kinds[G] = KindStats(count=1000, mean=1.4, variance=0.6)
    assert not policy.choose([f"r{i}" for i in range(64)], [G] * 64).speculate
    assert policy.choose(["new"], [G]).speculate
    misses(policy, "new", 12)
    assert not policy.choose(["new"], [G]).speculate


def test_the_batch_compares_its_mean_estimate_with_its_own_break_even():
    policy = AdaptiveSpeculation(costs({1: 1.5, 2: 1.5, 4: 2.4}))
    policy.kinds[G] = settled(2.9)
    policy.requests.update(good=known(3.0), bad=known(1.0))
    assert policy.choose(["good"], [G]).speculate
    assert not policy.choose(["bad"], [G]).speculate
    assert policy.choose(["good", "bad"], [G] * 2).speculate  # mean 2 >= 1.5
    # An unseen request counts at its kind's mean (2.9): 4 rows need 2.4 each.
    decision = policy.choose(["good", "bad", "new1", "new2"], [G] * 4)
    assert decision.speculate and decision.expected == pytest.approx((3 + 1 + 2 * 2.9) / 4)
    assert not policy.choose(["bad", "bad", "bad", "new"], [G] * 4).speculate
    policy.forget("bad")  # finished: a new request of that id starts from its kind's mean
    assert policy.choose(["bad"], [G]).expected == pytest.approx(2.9)


def test_a_request_estimate_is_the_mean_of_its_iterations_from_its_kinds():
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    policy.observe("a", 3)  # the first of its kind: nothing to start from
    assert policy.kinds[G].mean == 3 and policy.requests["a"].mean == 3
    policy.observe("a", 1)
    assert policy.requests["a"].mean == 2  # its own mean
    policy.observe("b", 4)  # b starts from its kind's mean 2, counted as the 2 it was made of
    assert policy.requests["b"].mean == pytest.approx((2 * 2 + 4) / 3)
    for _ in range(PRIOR_ITERATIONS):
        policy.observe("c", 4)  # c starts from the mean of a and b, counted as 3
    c = policy.requests["c"]
    assert c.mean == pytest.approx((3 * 8 / 3 + PRIOR_ITERATIONS * 4) / (3 + PRIOR_ITERATIONS))
    overall = policy.kinds[G].mean
    assert policy.kinds[G].count == 3 + PRIOR_ITERATIONS >= PRIOR_ITERATIONS
    policy.observe("d", 1)  # from here on a kind's mean counts as PRIOR_ITERATIONS
    prior = PRIOR_ITERATIONS * overall
    assert policy.requests["d"].mean == pytest.approx((prior + 1) / (PRIOR_ITERATIONS + 1))
    mean_len = LONG_RUN - PRIOR_ITERATIONS
    for _ in range(mean_len - 1):
        policy.observe("d", 1)
    assert policy.requests["d"].mean == pytest.approx((prior + mean_len) / LONG_RUN)
    before = policy.requests["d"].mean  # from here on, a moving average of LONG_RUN iterations
    policy.observe("d", 4)
    assert policy.requests["d"].mean == pytest.approx(before + (4 - before) / LONG_RUN)
    overall = policy.kinds[G].mean
    policy.forget("d")  # finished: a new request of that id starts afresh from its kind's
    policy.observe("d", 1)
    assert policy.requests["d"].count == 1
    assert policy.requests["d"].mean == pytest.approx(
        overall + (1 - overall) / (PRIOR_ITERATIONS + 1)
    )


def test_a_draft_that_pays_on_average_keeps_speculating_through_bad_patches():
    """A chain S = 3 accepting 2.3 on average against a break-even of 1.8 (the default model's
    shipped draft and start-up costs on the H200): its iterations accept 1-4 tokens, in runs of
    misses. One request keeps speculating through 256 tokens; a moving average of weight 0.3
    sent it plain within about ten iterations."""
    import random

    rng = random.Random(0)
    policy = AdaptiveSpeculation(costs({1: 1.82}))
    policy.kinds[G] = KindStats(count=1000, mean=2.33, variance=1.45)  # accepted before
    kept = 0
    for request in range(20):
        rid, emitted = f"r{request}", 0
        while emitted < 256 and policy.choose([rid], [G]).speculate:
            accept = rng.choices([1, 2, 3, 4], weights=[38, 21, 11, 30])[0]
            policy.observe(rid, accept)
            emitted += accept
        kept += emitted >= 256
        policy.forget(rid)
    assert kept >= 18


def test_speculation_holds_within_the_hysteresis_and_returns_at_the_break_even():
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    policy.kinds[G] = settled(2.0)
    low = 2.0 * (1 - HYSTERESIS)
    for value, speculate in [
        (low + 0.01, True),
        (low - 0.01, False),
        (1.99, False),
        (2.0, True),
        (low + 0.01, True),
    ]:
        policy.requests["a"] = known(value)
        assert policy.choose(["a"], [G]).speculate is speculate, value


def test_sampled_batches_use_the_sampled_costs():
    policy = AdaptiveSpeculation(costs({1: 2.0, 2: 2.0}, sampled_factor=1.5))
    policy.kinds.update({G: settled(2.5), S: settled(2.5)})  # new requests: 2.5 each
    assert policy.choose(["a"], [G]).speculate  # 2.5 >= 2
    assert not policy.choose(["b"], [S]).speculate  # 2.5 < 3
    assert not policy.choose(["a", "b"], [G, S]).speculate  # one samples: 3 needed


def test_greedy_and_sampled_requests_learn_apart():
    """A new greedy request starts from what greedy requests accepted, not from sampled ones
    (whose drafts agree less): a mix of both does not keep greedy streams from speculating."""
    policy = AdaptiveSpeculation(costs({1: 2.0}))
    for _ in range(20):
        policy.observe("sampled", 1, S)
    assert policy.choose(["new"], [G]).speculate  # no greedy request seen yet: learn
    policy.observe("greedy", 3)
    assert policy.choose(["new"], [G]).expected == 3
    assert not policy.choose(["new"], [S]).speculate
    hotter = kind(SamplingParams(temperature=1.0))
    assert policy.choose(["new"], [hotter]).speculate  # a kind of its own: learn it


@pytest.mark.parametrize(
    "params, sampled",
    [
        (SamplingParams(temperature=0.0), False),
        (SamplingParams(temperature=0.7), True),
        (SamplingParams(temperature=0.7, top_k=1), False),
        (SamplingParams(temperature=1e-6), False),  # below GREEDY_EPS: the worker takes the argmax
        (SamplingParams(temperature=0.0, repetition_penalty=1.1), True),
        (SamplingParams(temperature=0.0, presence_penalty=0.5), True),
    ],
)
def test_which_requests_count_as_sampled(params, sampled):
    assert samples(params) is sampled


class PlainAwareWorker(FakeWorker):
    """The fake worker, answering a plain decode plan the way the real one does: one token per
    request and no verify counts."""

    def run(self, plan):
        if plan.mode != "decode" or plan.speculate:
            return super().run(plan)
        accept, self.accept = self.accept, lambda step, row: 1
        try:
            result = super().run(plan)
        finally:
            self.accept = accept
        self.plain_plans += 1
        return type(result)(result.plan_id, result.num_tokens, result.token_ids, result.logprobs)

    plain_plans = 0


def speculative_scheduler(step_costs: StepCosts | None, adaptive: str = "on") -> Scheduler:
    config = AerieConfig().replace(
        scheduler={"max_running_requests": 4},
        speculative={
            "speculative_algorithm": "EAGLE",
            "speculative_adaptive": adaptive,
            "speculative_step_costs": step_costs and step_costs.to_json(),
        },
    )
    return Scheduler(config, (), max_total_tokens=4096, decode_alloc_len=4)


def run_to_end(sched: Scheduler, worker: FakeWorker, collector: Collector) -> list:
    plans = []
    while sched.has_work():
        plan = sched.next_plan()
        assert plan is not None
        plans.append(plan)
        collector.add(sched.apply_result(plan, worker.run(plan)))
    return plans


@pytest.mark.parametrize("accept, expect_plain", [(1, True), (4, False)])
def test_the_scheduler_plans_plain_steps_when_the_draft_misses(accept, expect_plain):
    sched = speculative_scheduler(costs({1: 2.0, 2: 2.0, 4: 2.0}))
    worker, collector = PlainAwareWorker(accept=lambda step, row: accept, alloc_len=4), Collector()
    prompts = {"a": [1, 2, 3], "b": [4, 5]}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_new_tokens=60, ignore_eos=True))
    plans = run_to_end(sched, worker, collector)
    for rid, prompt in prompts.items():
        assert collector.outputs[rid] == reference_output(prompt, 60)
    decodes = [p for p in plans if p.mode == "decode"]
    plain = sum(not p.speculate for p in decodes)
    assert (plain > len(decodes) // 2) is expect_plain
    stats = sched.stats()
    assert stats.num_plain_steps == plain == worker.plain_plans
    assert stats.num_decode_steps == len(decodes)  # plain steps and iterations alike
    assert stats.break_even_accept_length == 2.0 and stats.speculating in (0, 1)
    # the last choice's estimate, give or take its standard error (a few iterations of 2 rows)
    assert 0 < stats.expected_accept_error < 1
    # Acceptance counts speculative iterations only: position 0 counts every one of them.
    assert sched.stats().accepted_per_position[0] == 2 * (len(decodes) - plain)


def test_plain_steps_count_as_one_forward_each_in_the_accept_length():
    sched = speculative_scheduler(costs({1: 2.0}))
    worker = PlainAwareWorker(alloc_len=4)
    sched.add_request(make_request("a", [1, 2, 3], max_new_tokens=40, ignore_eos=True))
    verify_ct = {}
    plans = []
    while sched.has_work():
        plan = sched.next_plan()
        plans.append(plan)
        for d in outputs_of(sched.apply_result(plan, worker.run(plan))):
            verify_ct[d.rid] = d.spec_verify_ct
    assert worker.plain_plans > 0
    assert verify_ct["a"] == sum(p.mode == "decode" for p in plans)  # tokens per target forward


@pytest.mark.parametrize("adaptive, step_costs", [("off", costs({1: 100.0})), ("on", None)])
def test_fixed_speculation_and_unmeasured_costs_always_speculate(adaptive, step_costs):
    sched = speculative_scheduler(step_costs, adaptive)
    worker, collector = PlainAwareWorker(alloc_len=4), Collector()
    sched.add_request(make_request("a", [1, 2, 3], max_new_tokens=30, ignore_eos=True))
    plans = run_to_end(sched, worker, collector)
    assert all(p.speculate for p in plans) and worker.plain_plans == 0


def test_the_first_iteration_after_plain_steps_is_not_observed():
    """It drafts from the state before the plain steps: the policy must not learn from it."""
    sched = speculative_scheduler(costs({1: 2.0}))
    # Probing iterations accept everything (4 tokens), a stale draft's first one only 1.
    fresh = {"value": True}

    def accept(step, row):
        return 4 if fresh["value"] else 1

    worker, collector = PlainAwareWorker(accept=accept, alloc_len=4), Collector()
    sched.add_request(
        make_request("a", [1, 2, 3], max_new_tokens=400, ignore_eos=True, temperature=0.0)
    )
    observed = []
    real_observe = sched.adaptive.observe
    sched.adaptive.observe = lambda rid, n, k: (observed.append(n), real_observe(rid, n, k))
    sched.adaptive.kinds[G] = settled(1.0)  # learned before: this draft misses
    sched.adaptive.requests["a"] = known(1.0)
    previous_plain = False
    while sched.has_work():
        plan = sched.next_plan()
        if plan.mode == "decode":
            fresh["value"] = plan.speculate and not previous_plain
            previous_plain = not plan.speculate
        collector.add(sched.apply_result(plan, worker.run(plan)))
    assert collector.outputs["a"] == reference_output([1, 2, 3], 400)
    assert worker.plain_plans > 0
    assert observed and set(observed) == {4}  # never the stale iteration's 1
