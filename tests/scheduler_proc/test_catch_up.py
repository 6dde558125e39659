"""The drafts' catch-up after plain steps (`scheduler_proc.catch_up`), in the scheduler with the
fake worker, which refuses a speculative decode of a row whose draft has not run at its newest
position, and checks that a catch-up reruns exactly the row's committed tokens."""

from __future__ import annotations

import pytest

from aerie.codec import unpack_ids
from aerie.config import AerieConfig
from scheduler_proc.catch_up import CATCH_UP_MAX
from scheduler_proc.scheduler import Scheduler
from tests.scheduler_proc.fake_worker import Collector, make_request, reference_output, run_to_end
from tests.scheduler_proc.test_adaptive import G, PlainAwareWorker, costs


def adaptive_scheduler(page_size: int = 1, chunk: int = 8192, overlap: bool = True) -> Scheduler:
    config = AerieConfig().replace(
        cache={"page_size": page_size},
        scheduler={"max_running_requests": 4, "chunked_prefill_size": chunk,
                   "disable_overlap_schedule": not overlap},
        speculative={"speculative_algorithm": "EAGLE",
                     "speculative_step_costs": costs({1: 2.0, 2: 2.0, 4: 2.0}).to_json()},
    )  # fmt: skip
    return Scheduler(config, (), max_total_tokens=8192, decode_alloc_len=4)


def catch_ups(plans) -> list:
    """The catch-up steps among the planned ones: extends that sample for nobody."""
    return [p for p in plans if p.mode == "extend" and not any(e.sample for e in p.requests)]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_iteration_after_plain_steps_drafts_from_the_newest_position(page_size, overlap):
    """Drafts that miss, then agree: the batch goes plain, and a probe or the switch back finds
    every draft caught up (the fake worker asserts it); outputs are the target's own."""
    sched = adaptive_scheduler(page_size, overlap=overlap)
    agree = {"value": False}
    worker = PlainAwareWorker(accept=lambda step, row: 4 if agree["value"] else 1, alloc_len=4)
    collector = Collector()
    prompts = {"a": [1, 2, 3], "b": [4, 5, 6, 7, 8], "c": [9]}
    for rid, prompt in prompts.items():
        sched.add_request(make_request(rid, prompt, max_new_tokens=300, ignore_eos=True,
                                       temperature=0.0))  # fmt: skip

    def on_step(number, planned):
        agree["value"] = number > 150  # the drafts start agreeing partway

    plans = run_to_end(sched, worker, collector, on_step=on_step)
    for rid, prompt in prompts.items():
        assert collector.outputs[rid] == reference_output(prompt, 300)
    decodes = [p for p in plans if p.mode == "decode"]
    assert any(not p.plan.speculate for p in decodes[:100])  # plain while the drafts miss
    assert all(p.plan.speculate for p in decodes[-10:])  # speculating again at the end
    rerun = catch_ups(plans)
    assert rerun
    stats = sched.stats()
    assert stats.num_catch_up_tokens == sum(len(e.input_ids) for p in rerun for e in p.requests)
    # A catch-up reruns what the plain steps since the last one decoded: no more than them.
    assert stats.num_catch_up_tokens <= worker.plain_plans * len(prompts)


def test_a_probe_is_learnt_from_once_the_drafts_caught_up():
    sched = adaptive_scheduler(overlap=False)
    worker = PlainAwareWorker(accept=lambda step, row: 4, alloc_len=4)
    sched.add_request(make_request("a", [1, 2, 3], max_new_tokens=400, ignore_eos=True,
                                   temperature=0.0))  # fmt: skip
    sched.adaptive.overall[G] = 1.0  # learnt before: this kind's drafts miss
    observed = []
    real_observe = sched.adaptive.observe
    sched.adaptive.observe = lambda rid, n, k: (observed.append(n), real_observe(rid, n, k))
    collector = Collector()
    plans = run_to_end(sched, worker, collector)
    assert collector.outputs["a"] == reference_output([1, 2, 3], 400)
    decodes = [p.plan for p in plans if p.mode == "decode"]
    first = next(i for i, plan in enumerate(decodes) if plan.speculate)
    assert first > 0  # it started plain, from its kind's estimate; then a probe found 4
    assert observed[0] == 4
    assert all(plan.speculate for plan in decodes[first + 1 :])  # ... and it switched back


def test_a_long_plain_run_reruns_its_last_positions_within_the_budget():
    """Two requests with more plain steps than CATCH_UP_MAX, a prefill budget of 100 tokens:
    each reruns its last 50 positions, ending at its committed length."""
    sched = adaptive_scheduler(chunk=100)
    worker, collector = PlainAwareWorker(alloc_len=4), Collector()
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, [1, 2, 3], max_new_tokens=CATCH_UP_MAX + 40,
                                       ignore_eos=True, temperature=0.0))  # fmt: skip
    sched.adaptive.overall[G] = 1.0
    sched.adaptive.probe_interval = 10 * CATCH_UP_MAX  # no probe before the switch below

    def on_step(number, planned):
        if number == CATCH_UP_MAX + 20:
            sched.adaptive.overall[G] = sched.adaptive.estimates["a"] = 4.0
            sched.adaptive.estimates["b"] = 4.0

    plans = run_to_end(sched, worker, collector, on_step=on_step)
    for rid in ("a", "b"):
        assert collector.outputs[rid] == reference_output([1, 2, 3], CATCH_UP_MAX + 40)
    (catch_up,) = catch_ups(plans)
    assert [len(e.input_ids) for e in catch_up.requests] == [50, 50]
    assert all(not e.sample and e.slot_start == e.prefix_len for e in catch_up.requests)
    assert unpack_ids(catch_up.plan.sample) == [0, 0]
