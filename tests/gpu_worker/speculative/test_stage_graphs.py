"""The speculative stages as `StageGraph`s: padding to the dummy row, static buffers, replays
that never drift, and unchanged greedy output. On CPU the padded path runs eagerly (what CI
covers); on CUDA (AERIE_SPEC_TEST_DEVICE=cuda) the stages are captured and replayed, and the
whole iteration runs under `torch.cuda.set_sync_debug_mode("error")`."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from aerie.codec import pack_ids, unpack_ids
from aerie.messages import SamplingParams, TokenizedRequest
from gpu_worker.graphs.stage_graph import StageGraph, tensor_fields
from gpu_worker.speculative import iteration
from gpu_worker.speculative.stage_buffers import GreedyProposal, Proposal, ProposeInputs
from gpu_worker.step.plan_arrays import parse_plan
from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import drive, outputs_of
from tests.gpu_worker.mtp_checkpoints import make_tiny_mtp_target
from tests.gpu_worker.speculative.test_eagle_worker import (
    DEVICE,
    make_config,
    random_prompts,
    run_engine,
)
from tests.gpu_worker.speculative.trees import TREE_FIELDS


def serve_until_decode(config, prompts, extra=None, logprobs=False):
    """A worker and scheduler with `prompts` prefilled (greedy, or with the SamplingParams
    fields `extra`); returns them and the first decode plan."""
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            max_new_tokens=40, ignore_eos=True, **(extra or {"temperature": 0.0})
        )
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params, logprobs))
    while True:
        plan = sched.next_plan()
        if plan.mode == "decode":
            return worker, sched, plan
        sched.apply_result(plan, worker.execute(plan))


@pytest.mark.parametrize("topk, num_draft", [(1, 4), (2, 6)])
def test_replayed_proposal_never_drifts(models, topk, num_draft):
    """The graph-capture restore contract: the proposal stage (S draft steps, tree selection and
    the verify forward) replayed several times on the same inputs gives the eager stage's tree,
    positions and logits every time, and leaves its inputs as they were."""
    config = make_config(
        models["target"], "EAGLE", models["eagle"], 3, topk, num_draft, page_size=4, graph_max_bs=4
    )
    worker, _, plan = serve_until_decode(config, random_prompts(seed=8, n=3))
    spec = worker.spec
    rows = worker._write_slots(parse_plan(plan, worker.max_running_requests))
    inputs = ProposeInputs(rows)
    seq_cpu = worker.rows.committed_lens[rows].tolist()
    state = worker.rows.committed_lens.clone(), worker.rows.tokens.clone()
    before = rows.clone()
    proposal = spec.propose(True, len(seq_cpu), inputs, seq_cpu)
    eager = {k: v.clone() for k, v in tensor_fields(proposal).items()}
    for _ in range(3):
        replayed = spec.propose_stages["accept"](inputs, seq_cpu)
        assert type(replayed) is Proposal
        for name in (*TREE_FIELDS, "features"):
            value = getattr(replayed, name)
            assert torch.equal(value, eager[name]) or torch.allclose(
                value.float(), eager[name].float(), atol=1e-4
            ), name
        torch.testing.assert_close(replayed.logits, eager["logits"], atol=1e-4, rtol=1e-4)
        # a greedy batch's capture accepts the same way and hands an accept stage nothing
        greedy = spec.propose_stages["greedy"](inputs, seq_cpu)
        assert type(greedy) is GreedyProposal
        handed = {f.name for f in dataclasses.fields(greedy)}
        assert not handed & {*TREE_FIELDS, "logits", "features"}
        for name in ("greedy_tokens", "greedy_accept_lens", "rows", "committed_lens"):
            assert torch.equal(getattr(greedy, name), eager[name]), name
        assert torch.equal(inputs.rows, before)
        # the proposal reads the rows' lengths and tokens; only the extend advances them
        assert torch.equal(worker.rows.committed_lens, state[0])
        assert torch.equal(worker.rows.tokens, state[1])


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory) -> str:
    return make_tiny_mtp_target(str(tmp_path_factory.mktemp("mtp") / "target"), num_mtp_layers=3)


@pytest.mark.parametrize(
    "algorithm, steps, topk, num_draft, page_size",
    [
        ("EAGLE", 3, 1, 4, 1),
        ("EAGLE", 3, 2, 6, 4),
        ("EAGLE3", 2, 2, 5, 1),
        ("MTP", 3, 1, 4, 4),
    ],
)
def test_graphed_stages_keep_greedy_output(
    models, mtp_target, algorithm, steps, topk, num_draft, page_size
):
    """Batches of 6 .. 1 requests (buckets 8, 4, 2, 1: padded rows) through the stage graphs
    give the target's own greedy output."""
    target = mtp_target if algorithm == "MTP" else models["target"]
    draft = {"EAGLE": models["eagle"], "EAGLE3": models["eagle3"], "MTP": None}[algorithm]
    prompts = random_prompts(seed=31, n=6)
    lengths = [4, 7, 10, 13, 16, 19]  # requests finish one after another: the batch shrinks
    base, _, _ = run_engine(make_config(target, page_size=page_size), prompts, lengths)
    config = make_config(
        target, algorithm, draft, steps, topk, num_draft, page_size, graph_max_bs=8
    )
    spec, _, counts = run_engine(config, prompts, lengths)
    assert spec == base
    assert all(1 <= n <= steps + 1 for n in counts)


def serve_mixed(config, prompts, requests, inspect=None):
    """Serve prompts with per-request (max_new_tokens, extra SamplingParams fields, logprobs)
    to the end; returns each request's tokens and logprobs. Without the overlap schedule,
    checks after every decode step that each row's `RowState` holds the last token it emitted
    and the committed length (prompt + tokens emitted so far - 1), and that the dummy row 0
    holds token 0 at length 0. inspect(worker) runs once the worker is built."""
    worker = GPUWorker(config)
    if inspect is not None:
        inspect(worker)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    for i, (prompt, (limit, extra, logprobs)) in enumerate(zip(prompts, requests, strict=True)):
        params = SamplingParams(max_new_tokens=limit, ignore_eos=True, **extra)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params, logprobs))
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    logprobs = {f"r{i}": [] for i in range(len(prompts))}

    def collect(plan, result, deltas):
        for d in deltas:
            tokens[d.rid] += d.token_ids
            logprobs[d.rid] += d.logprobs

    if not config.scheduler.disable_overlap_schedule:
        drive(sched, worker, collect)
        return tokens, logprobs
    emitted = {f"r{i}": 0 for i in range(len(prompts))}
    while sched.has_work():
        plan = sched.next_plan()
        rids = sched.plan_rids(plan)
        result = worker.execute(plan)
        counts, ids = unpack_ids(result.num_tokens), unpack_ids(result.token_ids)
        ends = np.cumsum(counts)
        for rid, row, n, end in zip(rids, unpack_ids(plan.rows), counts, ends, strict=True):
            emitted[rid] += n
            if plan.mode == "decode":
                assert worker.rows.tokens[row].item() == ids[end - 1]
                prompt_len = len(prompts[int(rid[1:])])
                assert worker.rows.committed_lens[row].item() == prompt_len + emitted[rid] - 1
        # padded rows of a graph bucket commit into the dummy row 0, which must be reset
        assert worker.rows.committed_lens[0].item() == 0 == worker.rows.tokens[0].item()
        collect(plan, result, outputs_of(sched.apply_result(plan, result)))
    assert sched.allocator.is_whole()
    return tokens, logprobs


GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
PENALISED = {"temperature": 0.0, "frequency_penalty": 0.6}


@pytest.mark.parametrize(
    "requests",
    [
        # sampled and penalised requests end first: greedy batches (with and without logprobs)
        # follow batches that run an accept stage, as the batch shrinks through the buckets
        [
            (30, GREEDY, False),
            (24, GREEDY, False),
            (9, SAMPLED, False),
            (12, PENALISED, False),
            (16, GREEDY, True),
        ],
        # a sampled request whose long prompt is still being prefilled joins greedy batches
        [(20, GREEDY, False), (20, GREEDY, True), (14, SAMPLED, False)],
    ],
)
def test_graphed_stages_serve_mixed_batches_like_direct_calls(models, requests, monkeypatch):
    """Greedy batches chain the propose stage's outputs into the extend stage's inputs; other
    batches run an accept stage that reads the propose stage's outputs in place and writes
    the extend stage's inputs over them (penalised ones directly). Batches of either kind, in
    any order and size, give the tokens and logprobs of the unpadded direct calls. The accept
    graphs are captured for buckets of up to 2 requests here (12 tree nodes), so the larger
    buckets run their padded path eagerly."""
    monkeypatch.setattr(iteration, "ACCEPT_GRAPH_ROWS", 12)
    prompts = random_prompts(seed=12, n=len(requests))
    prompts[-1] = prompts[-1] * 4  # the last prompt is long: prefilled in several chunks

    def serve(graph_max_bs, overlap=True):
        config = make_config(
            models["target"],
            "EAGLE",
            models["eagle"],
            3,
            2,
            6,
            page_size=4,
            chunk=8,
            graph_max_bs=graph_max_bs,
            overlap=overlap,
        )
        return serve_mixed(config, prompts, requests, inspect)

    def inspect(worker):
        for name, stage in worker.spec.accept_stages.items():
            captured = sorted(getattr(stage, "graphs", {}))
            graphed = DEVICE == "cuda" and isinstance(stage, StageGraph)
            assert captured == ([1, 2] if graphed else []), name

    direct_tokens, direct_logprobs = serve(0)
    graphed_tokens, graphed_logprobs = serve(8)
    assert graphed_tokens == direct_tokens
    assert serve(8, overlap=False)[0] == serve(0, overlap=False)[0] == direct_tokens
    assert all(len(direct_tokens[f"r{i}"]) == r[0] for i, r in enumerate(requests))
    for rid, values in direct_logprobs.items():
        torch.testing.assert_close(
            torch.tensor(graphed_logprobs[rid]), torch.tensor(values), atol=1e-4, rtol=1e-4
        )
    assert any(direct_logprobs.values())


@pytest.mark.skipif(DEVICE != "cuda", reason="host synchronisation is a CUDA matter")
@pytest.mark.parametrize(
    "algorithm, topk, num_draft, requests",
    [
        ("EAGLE", 1, 4, "greedy"),
        ("EAGLE", 2, 6, "greedy"),
        ("MTP", 1, 4, "greedy"),
        ("EAGLE", 1, 4, "sampled"),
        ("EAGLE", 2, 6, "filtered"),
        ("MTP", 1, 4, "logprobs"),
        ("EAGLE", 2, 6, "penalised"),
    ],
)
def test_the_iteration_never_synchronises(
    models, mtp_target, monkeypatch, algorithm, topk, num_draft, requests
):
    """Greedy batches, and batches through each accept variant, graphed or direct."""
    target = mtp_target if algorithm == "MTP" else models["target"]
    draft = None if algorithm == "MTP" else models["eagle"]
    config = make_config(target, algorithm, draft, 3, topk, num_draft, page_size=4)
    extra = {
        "greedy": None,
        "logprobs": None,
        "sampled": SAMPLED,
        "penalised": PENALISED,
        "filtered": {"temperature": 0.7, "top_k": 20, "min_p": 0.1, "seed": 2},
    }[requests]
    worker, sched, plan = serve_until_decode(
        config, random_prompts(seed=9, n=3), extra, logprobs=requests == "logprobs"
    )
    original = worker.spec.decode
    calls = []

    def strict(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return original(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(True)

    monkeypatch.setattr(worker.spec, "decode", strict)
    for _ in range(4):
        sched.apply_result(plan, worker.execute(plan))
        plan = sched.next_plan()
    assert len(calls) == 4
