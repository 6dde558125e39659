"""Adaptive speculation in the real engine: decode steps that switch between plain decoding and
speculative iterations, mid-request and in any order, keep the output exact.

The switches come from a fixed pattern in place of the policy's choice (the policy itself is
tested in tests/scheduler_proc/test_adaptive.py), so every algorithm meets plain steps before,
between and after its iterations, with the overlap schedule's two plans in flight.
"""

from __future__ import annotations

import itertools

import pytest

from aerie.codec import pack_ids
from aerie.messages import SamplingParams, TokenizedRequest
from aerie.step_costs import StepCosts
from gpu_worker.tooling.step_costs import measure_step_costs
from gpu_worker.worker import GPUWorker
from scheduler_proc.adaptive import AdaptiveSpeculation, Decision
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import drive
from tests.gpu_worker.mtp_checkpoints import make_tiny_mtp_target
from tests.gpu_worker.speculative.test_eagle_worker import make_config, random_prompts, run_engine

COSTS = StepCosts(
    (1,), {"greedy": (1.0,), "sampled": (1.0,)}, {"greedy": (2.0,), "sampled": (2.0,)}
).to_json()  # (the pattern decides)


def adaptive_config(*args, **kwargs):
    """A speculative config whose scheduler runs adaptive speculation (given step costs)."""
    config = make_config(*args, **kwargs)
    return config.replace(speculative={"speculative_step_costs": COSTS})


# Plain steps alone, in pairs and runs, between iterations (1: speculate).
PATTERN = (1, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1, 1, 1)


class Switching(list):
    """The choices made (True: speculate), and the plain steps the worker ran."""

    plain_launches = 0


@pytest.fixture
def switching(monkeypatch):
    """Every decode step's choice follows PATTERN, cycled."""
    pattern, made = itertools.cycle(PATTERN), Switching()

    def choose(self, rids, sampled):
        made.append(bool(next(pattern)))
        return Decision(made[-1], None, 0.0)

    launch_decode = GPUWorker._launch_decode

    def counted(self, *args):
        made.plain_launches += 1
        return launch_decode(self, *args)

    monkeypatch.setattr(AdaptiveSpeculation, "choose", choose)
    monkeypatch.setattr(GPUWorker, "_launch_decode", counted)
    return made


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    return make_tiny_mtp_target(str(tmp_path_factory.mktemp("mtp") / "t"), num_mtp_layers=3)


@pytest.mark.parametrize(
    "algorithm, steps, topk, num_draft, page_size, chunk, overlap",
    [
        ("EAGLE", 3, 1, 4, 1, 64, True),
        ("EAGLE", 3, 2, 6, 4, 4, True),
        ("EAGLE3", 3, 1, 4, 4, 4, True),
        ("EAGLE3", 3, 2, 5, 1, 64, False),
        ("MTP", 3, 1, 4, 4, 4, True),
    ],
)
def test_switching_between_plain_and_speculative_steps_keeps_greedy_output(
    models, mtp_target, switching, algorithm, steps, topk, num_draft, page_size, chunk, overlap
):
    target = mtp_target if algorithm == "MTP" else models["target"]
    draft = {"EAGLE": models["eagle"], "EAGLE3": models["eagle3"], "MTP": None}[algorithm]
    prompts = random_prompts(seed=steps * 10 + topk)
    base, _, _ = run_engine(make_config(target, page_size=page_size), prompts, 24)
    switching.clear()
    switching.plain_launches = 0
    config = adaptive_config(
        target, algorithm, draft, steps, topk, num_draft, page_size, chunk, overlap=overlap
    )
    outputs, verify_ct, counts = run_engine(config, prompts, 24)
    assert outputs == base
    assert sum(switching) > 3 and sum(not s for s in switching) > 3  # both kinds ran
    assert switching.plain_launches == sum(not s for s in switching)  # as plain steps
    assert all(1 <= n <= steps + 1 for n in counts)
    # A plain step counts as one target forward: tokens per forward stay >= 1.
    assert all(len(outputs[rid]) >= v > 0 for rid, v in verify_ct.items())


# Sharp enough that the agreeing draft often matches the bigram target's draws (its top logit
# leads the others by about 1).
SAMPLED = SamplingParams(temperature=0.15, top_p=0.95, frequency_penalty=0.2)


@pytest.mark.parametrize(
    "algorithm, steps, topk, num_draft",
    [("agreeing", 3, 1, 4), ("agreeing", 3, 2, 6), ("EAGLE3", 2, 4, 8), ("MTP", 3, 1, 4)],
)
def test_seeded_sampled_requests_draw_plain_decodings_tokens_through_switches(
    models, mtp_target, switching, algorithm, steps, topk, num_draft
):
    """A seeded sampled request gets the tokens a plain engine draws with its seed, whatever
    mix of plain steps and iterations serves it: acceptance draws what plain decoding would.
    So adaptive choices (which depend on other requests) never change a seeded answer.
    ("agreeing": an EAGLE draft that predicts its bigram target, so drafts get accepted.)"""
    target = {"MTP": mtp_target, "agreeing": models["bigram"]}.get(algorithm, models["target"])
    draft = {"agreeing": models["agreeing"], "EAGLE3": models["eagle3"]}.get(algorithm)
    prompts = random_prompts(seed=steps + topk)
    base, _, _ = run_engine(make_config(target), prompts, 24, sampling=SAMPLED)
    switching.clear()
    kind = "EAGLE" if algorithm == "agreeing" else algorithm
    config = adaptive_config(target, kind, draft, steps, topk, num_draft, page_size=4)
    outputs, _, counts = run_engine(config, prompts, 24, sampling=SAMPLED)
    assert outputs == base
    assert sum(switching) > 3 and sum(not s for s in switching) > 3  # both kinds ran
    if algorithm == "agreeing":
        assert sum(n > 1 for n in counts) >= 5  # drafts were accepted


def test_a_speculative_worker_without_adaptive_refuses_plain_plans(models, monkeypatch):
    monkeypatch.setattr(
        AdaptiveSpeculation, "choose", lambda self, rids, sampled: Decision(False, None, 0.0)
    )
    config = adaptive_config(models["target"], "EAGLE", models["eagle"], 2, 1, 3)
    worker = GPUWorker(config.replace(speculative={"speculative_adaptive": "off"}))
    assert worker.decode_step is None
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    sched.add_request(
        TokenizedRequest(
            "r", pack_ids([3, 4, 5]), SamplingParams(max_new_tokens=4, temperature=0.0)
        )
    )
    with pytest.raises(ValueError, match="speculative-adaptive"):
        drive(sched, worker)


def test_step_costs_are_measured_on_the_dummy_row_without_a_trace(models):
    """Every bucket gets positive plain and speculative times, and requests served after the
    measurement get the output they get without it (it ran on the reserved row 0 only)."""
    config = make_config(models["target"], "EAGLE3", models["eagle3"], 3, 1, 4)
    prompts = random_prompts(seed=2, n=3)
    expected, _, _ = run_engine(config, prompts, 12)
    worker = GPUWorker(config)
    costs = measure_step_costs(worker, repeats=2, warmup=1)
    assert costs.buckets == (1, 2, 4, 8)  # up to the 8 request rows
    for table in (costs.plain, costs.speculative):
        assert all(t > 0 for times in table.values() for t in times)
    assert costs.break_even(1, False) > 0
    assert int(worker.rows.committed_lens[0]) == 0 and int(worker.rows.tokens[0]) == 0
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    drive(
        sched,
        worker,
        lambda plan, result, deltas: [outputs[d.rid].extend(d.token_ids) for d in deltas],
    )
    assert outputs == expected
