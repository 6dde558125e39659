"""GPUWorker.execute on ForwardPlans: chunked prefill + decode for two requests reproduces HF
greedy tokens (and logprobs); the process loop answers plans over real sockets."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from aerie import codec, endpoints
from aerie.config import AerieConfig
from aerie.messages import (
    ForwardPlan,
    RequestStart,
    SamplingParams,
    Shutdown,
    StepResult,
    TokenizedRequest,
)
from aerie.plans import decode_plan, extend_plan, slot_columns
from aerie.transport import Inbox, Sender, StepLink
from gpu_worker.process import WorkerLoop
from gpu_worker.tooling.warm_up import run_warm_up, warm_up_plans
from gpu_worker.worker import GPUWorker
from scheduler_proc.policy import NewTokenEstimate
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import drive
from tests.gpu_worker.checkpoints import reference_logits

PAGE_SIZE = 4


def make_config(model_dir: str, runtime_dir: str = "") -> AerieConfig:
    return AerieConfig(runtime_dir=runtime_dir).replace(
        model={"model_path": model_dir, "device": "cpu", "dtype": "float32"},
        cache={"max_total_tokens": 64, "page_size": PAGE_SIZE},
        scheduler={"max_running_requests": 4},
        runner={"attention_backend": "torch_native"},
    )


class FakeScheduler:
    """Just enough scheduling for the test: one row and a list of pages per request."""

    def __init__(self, pages: list[int]) -> None:
        self.free_pages = pages
        self.slots: dict[str, list[int]] = {}

    def slots_for(self, rid: str, start: int, n: int) -> list[int]:
        slots = self.slots.setdefault(rid, [])
        while len(slots) < start + n:
            page = self.free_pages.pop()
            slots.extend(range(page * PAGE_SIZE, (page + 1) * PAGE_SIZE))
        return slots[start : start + n]

    def chunk(self, rid, row, committed_len, ids, sample):
        return (row, committed_len, ids, self.slots_for(rid, committed_len, len(ids)), sample)


def greedy_start(row: int, ids: list[int], return_logprob: bool = False) -> RequestStart:
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    return RequestStart(row, params, return_logprob, codec.pack_ids(ids))


def hf_greedy(reference, ids: list[int], num_new: int) -> tuple[list[int], list[float]]:
    seq, logprobs = list(ids), []
    for _ in range(num_new):
        logits = reference_logits(reference, seq)[-1]
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        seq.append(token)
    return seq[len(ids) :], logprobs


@pytest.mark.parametrize("warm_up", [False, True])
def test_execute_chunked_prefill_and_decode_gives_hf_greedy(tiny_dirs, reference_models, warm_up):
    """warm_up: the start-up warm-up ran first, on rows 1 and 2 and KV slots 4..96, where the
    requests use rows 2 and 3 and slots 4..67; they must not see it."""
    pool = 128 if warm_up else 64
    worker = GPUWorker(make_config(tiny_dirs["llama"]).replace(cache={"max_total_tokens": pool}))
    assert worker.info()["max_total_tokens"] == pool
    if warm_up:
        assert run_warm_up(worker) is not None
    sched = FakeScheduler(pages=[9, 2, 14, 5, 11, 3, 7, 12, 1, 16, 8])
    a, b = [5, 17, 99, 3, 42, 7, 8], [200, 1, 64]
    # Step 1: a's first chunk (no token) and all of b.
    plan = extend_plan(
        1,
        [sched.chunk("a", 2, 0, a[:4], False), sched.chunk("b", 3, 0, b, True)],
        starts=[greedy_start(2, a, return_logprob=True), greedy_start(3, b)],
    )
    result = worker.execute(plan)
    assert codec.unpack_ids(result.num_tokens) == [0, 1]
    out = {"a": [], "b": codec.unpack_ids(result.token_ids)}
    assert result.logprobs == b""  # only a (not sampled this step) asked for logprobs
    # Step 2: a's last chunk.
    result = worker.execute(extend_plan(2, [sched.chunk("a", 2, 4, a[4:], True)]))
    out["a"] += codec.unpack_ids(result.token_ids)
    logprobs_a = codec.unpack_floats(result.logprobs)
    # Steps 3..6: decode both; the worker has each row's last token and length.
    for step in range(4):
        positions = [len(p) + len(out[rid]) - 1 for rid, p in (("a", a), ("b", b))]
        new = [(n, sched.slots_for(rid, n, 1)) for rid, n in zip("ab", positions, strict=True)]
        result = worker.execute(decode_plan(3 + step, [2, 3], *slot_columns(new)))
        assert codec.unpack_ids(result.num_tokens) == [1, 1]
        token_a, token_b = codec.unpack_ids(result.token_ids)
        out["a"].append(token_a)
        out["b"].append(token_b)
        logprobs_a.append(codec.unpack_floats(result.logprobs)[0])
    reference = reference_models("llama")
    expected_a, expected_logprobs_a = hf_greedy(reference, a, 5)
    assert out["a"] == expected_a
    assert out["b"] == hf_greedy(reference, b, 5)[0]
    torch.testing.assert_close(
        torch.tensor(logprobs_a), torch.tensor(expected_logprobs_a), atol=1e-4, rtol=0
    )


def test_warm_up_plans_fit_the_pool_or_are_skipped(tiny_dirs):
    worker = GPUWorker(make_config(tiny_dirs["llama"]))  # a pool of 64 tokens
    plans = warm_up_plans(2, PAGE_SIZE, worker.runner.vocab_size, draft_lengths=[1, 2, 3])
    chunk_lens = [codec.unpack_ids(p.extend_lens) for p in plans]
    assert chunk_lens == [[5], [40], [3, 41], [2], [1], [3]]  # FEW_ROWS (2) once
    for plan in plans:  # each request's run of slots starts on a page (slot = run + position)
        starts, lens = codec.unpack_ids(plan.slot_starts), codec.unpack_ids(plan.slot_lens)
        slots = codec.unpack_ids(plan.slots)
        firsts = [slots[sum(lens[:i])] for i in range(len(lens))]
        assert all(
            (f - p) % PAGE_SIZE == 0 and f >= PAGE_SIZE for f, p in zip(firsts, starts, strict=True)
        )
    all_slots = [s for p in plans for s in codec.unpack_ids(p.slots)]
    assert len(all_slots) == len(set(all_slots))  # no two requests share a slot
    assert max(all_slots) >= 64
    # 64 tokens are too few for both rows: row 1 alone (its two plans) fits
    began = worker.sampling._flags_cpu.copy()
    assert run_warm_up(worker) is not None
    assert bool((worker.sampling._flags_cpu == began).all())  # greedy dummies set no flags
    small = make_config(tiny_dirs["llama"]).replace(cache={"max_total_tokens": 40})
    assert run_warm_up(GPUWorker(small)) is None  # not even row 1's 40-token chunk
    short = make_config(tiny_dirs["llama"]).replace(
        model={"context_length": 32}, cache={"max_total_tokens": 256}
    )
    assert run_warm_up(GPUWorker(short)) is None  # positions past the context: skipped


def test_the_warm_up_runs_its_plans_at_every_key_split_count(tiny_dirs, monkeypatch):
    """The extend kernel's split count is a constexpr the batch's shape picks: the warm-up
    compiles each count it can take, then leaves the choice to the shape again."""
    from gpu_worker.kernels import extend_attention

    worker = GPUWorker(make_config(tiny_dirs["llama"]).replace(cache={"max_total_tokens": 128}))
    seen = []
    execute = worker.execute

    def recording(plan):
        seen.append(extend_attention.FORCED_SPLITS)
        return execute(plan)

    monkeypatch.setattr(worker, "execute", recording)
    assert run_warm_up(worker) is not None
    per_count = len(seen) // len(extend_attention.SPLIT_COUNTS)
    assert seen == [n for n in extend_attention.SPLIT_COUNTS for _ in range(per_count)]
    assert extend_attention.FORCED_SPLITS is None
    shapes = [(t, t, h, sms) for t in (1, 5, 40, 300) for h in (2, 9, 32) for sms in (8, 132)]
    assert {extend_attention.extend_num_splits(*s) for s in shapes} == set(
        extend_attention.SPLIT_COUNTS
    )


@pytest.mark.parametrize("graph_max_bs", [0, 4])  # direct, and padded to the bucket
def test_decode_step_commits_each_rows_own_token(tiny_dirs, graph_max_bs):
    """The decode step commits the argmax in its stage; a sampled row's newest token must then
    be the sampled one, every row's length grows by one per step, and the padded rows of a
    bucket leave the dummy row 0 at token 0 and length 0."""
    config = make_config(tiny_dirs["llama"]).replace(runner={"cuda_graph_max_bs": graph_max_bs})
    worker = GPUWorker(config)
    sched = FakeScheduler(pages=[9, 2, 14, 5, 11, 3, 7, 12, 1, 16, 8])
    prompts = {1: [5, 17, 99], 2: [200, 1, 64, 3], 3: [8, 8]}
    sampled = SamplingParams(temperature=1.5, max_new_tokens=8, seed=11)
    starts = [
        greedy_start(1, prompts[1]),
        RequestStart(2, sampled, False, codec.pack_ids(prompts[2])),
        greedy_start(3, prompts[3]),
    ]
    chunks = [sched.chunk(str(r), r, 0, ids, True) for r, ids in prompts.items()]
    result = worker.execute(extend_plan(1, chunks, starts))
    newest = dict(zip(prompts, codec.unpack_ids(result.token_ids), strict=True))
    lengths = {r: len(ids) for r, ids in prompts.items()}
    for step in range(4):
        new = [(lengths[r], sched.slots_for(str(r), lengths[r], 1)) for r in prompts]
        result = worker.execute(decode_plan(2 + step, list(prompts), *slot_columns(new)))
        newest = dict(zip(prompts, codec.unpack_ids(result.token_ids), strict=True))
        for r in prompts:
            lengths[r] += 1
            assert int(worker.rows.tokens[r]) == newest[r]
            assert int(worker.rows.committed_lens[r]) == lengths[r]
        assert int(worker.rows.tokens[0]) == 0 and int(worker.rows.committed_lens[0]) == 0


@pytest.mark.parametrize("graph_max_bs", [0, 4])
def test_decode_steps_record_their_new_slots_however_many(
    tiny_dirs, reference_models, graph_max_bs
):
    """A decode step records its new KV slots itself; one that brings more than its bucket
    takes (row 2's three positions of headroom: a bucket of 2 takes two slots) has them
    written before it, and later steps that bring none use them: HF greedy tokens, and
    req_to_token holds every slot."""
    config = make_config(tiny_dirs["llama"]).replace(runner={"cuda_graph_max_bs": graph_max_bs})
    worker = GPUWorker(config)
    sched = FakeScheduler(pages=[9, 2, 14, 5, 11, 3, 7, 12, 1, 16, 8])
    prompts = {1: [5, 17, 99], 2: [200, 1, 64, 3]}
    chunks = [sched.chunk(str(r), r, 0, ids, True) for r, ids in prompts.items()]
    starts = [greedy_start(r, ids) for r, ids in prompts.items()]
    result = worker.execute(extend_plan(1, chunks, starts))
    out = {r: [t] for r, t in zip(prompts, codec.unpack_ids(result.token_ids), strict=True)}
    headroom = {1: 1, 2: 3}  # row 2 is given three positions in its first step
    for step in range(3):
        new = []
        for r, ids in prompts.items():
            position = len(ids) + len(out[r]) - 1
            n = headroom[r] if step == 0 else (1 if r == 1 else 0)
            new.append((position, sched.slots_for(str(r), position, n) if n else []))
        result = worker.execute(decode_plan(2 + step, list(prompts), *slot_columns(new)))
        for r, token in zip(prompts, codec.unpack_ids(result.token_ids), strict=True):
            out[r].append(token)
    reference = reference_models("llama")
    for r, ids in prompts.items():
        assert out[r] == hf_greedy(reference, ids, 4)[0]
        length = len(ids) + 3
        table = worker.runner.req_to_token_pool.req_to_token[r, :length].tolist()
        assert table == sched.slots_for(str(r), 0, length)


@pytest.mark.parametrize("graph_max_bs", [0, 4])
def test_decode_steps_count_the_tokens_of_penalised_rows(tiny_dirs, graph_max_bs):
    """Frequency and presence penalties read each row's counts of its output tokens: the decode
    stage counts every token it emits for a penalised row (the prefill's sampled token too)."""
    worker = GPUWorker(
        make_config(tiny_dirs["llama"]).replace(runner={"cuda_graph_max_bs": graph_max_bs})
    )
    sched = FakeScheduler(pages=[9, 2, 14, 5, 11, 3, 7, 12, 1, 16, 8])
    prompt = [5, 17, 99]
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5, max_new_tokens=8)
    start = RequestStart(1, params, False, codec.pack_ids(prompt))
    result = worker.execute(extend_plan(1, [sched.chunk("r", 1, 0, prompt, True)], [start]))
    emitted = codec.unpack_ids(result.token_ids)
    for step in range(3):
        position = len(prompt) + len(emitted) - 1
        plan = decode_plan(
            2 + step, [1], *slot_columns([(position, sched.slots_for("r", position, 1))])
        )
        emitted += codec.unpack_ids(worker.execute(plan).token_ids)
    expected = torch.zeros_like(worker.sampling.counts[1])
    for token in emitted:
        expected[token] += 1
    assert torch.equal(worker.sampling.counts[1], expected)


def test_a_retracted_sampled_request_continues_its_draw(tiny_dirs):
    """Sampled requests served with the scheduler into a KV cache too small for all of them
    are retracted and recomputed; each keeps its seed (part of its params), so it emits the
    tokens it emits in a cache that fits everything, and different seeds give other tokens."""
    prompts = [[(7 * i + 3 * k) % 250 + 3 for k in range(5 + i)] for i in range(6)]

    def serve(max_total_tokens: int, seed_base: int) -> tuple[dict[str, list[int]], int]:
        config = make_config(tiny_dirs["llama"]).replace(
            cache={"max_total_tokens": max_total_tokens},
            scheduler={"max_running_requests": 6, "chunked_prefill_size": 16},
        )
        worker = GPUWorker(config)
        sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
        sched.new_tokens = NewTokenEstimate(0.0)  # admit on free KV alone: retractions happen
        for i, prompt in enumerate(prompts):
            params = SamplingParams(
                max_new_tokens=20, temperature=1.0, ignore_eos=True, seed=seed_base + i
            )
            sched.add_request(TokenizedRequest(f"r{i}", codec.pack_ids(prompt), params))
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}

        def collect(plan, result, deltas):
            for d in deltas:
                outputs[d.rid] += d.token_ids

        drive(sched, worker, collect)
        return outputs, sched.stats().num_retractions

    roomy, roomy_retractions = serve(512, seed_base=100)
    tight, tight_retractions = serve(96, seed_base=100)
    assert roomy_retractions == 0 and tight_retractions > 0
    assert all(len(out) == 20 for out in roomy.values())
    assert tight == roomy
    reseeded, _ = serve(512, seed_base=200)
    assert all(reseeded[rid] != roomy[rid] for rid in roomy)


def test_process_loop_answers_plans_and_stops_on_shutdown(tmp_path, tiny_dirs, reference_models):
    """Plans and results cross the step link, Shutdown comes to the ZMQ inbox."""
    config = make_config(tiny_dirs["qwen2"], runtime_dir=str(tmp_path))
    loop = WorkerLoop(config)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    link = StepLink.connect(endpoints.step_link(config))
    to_worker = Sender(f"ipc://{tmp_path}/gpu_worker.sock")
    ids = [3, 1, 4, 1, 5]
    sched = FakeScheduler(pages=[4, 9])
    link.send(extend_plan(7, [sched.chunk("r", 1, 0, ids, True)], [greedy_start(1, ids)]))
    result = Inbox(link).recv(timeout_s=30)
    assert isinstance(result, StepResult) and result.plan_id == 7
    assert codec.unpack_ids(result.token_ids) == hf_greedy(reference_models("qwen2"), ids, 1)[0]
    # What heartbeats report moved on the launch, on each layer (on a CPU), at the launch's end
    # and on the result: now idle.
    num_layers = len(loop.worker.runner.model.model.layers)
    assert loop.progress.snapshot() == ("", 0.0, 3 + num_layers)
    to_worker.send(Shutdown())
    thread.join(timeout=30)
    assert not thread.is_alive()
    to_worker.close()
    link.close()


def test_worker_requires_a_resolved_config(tiny_dirs):
    config = make_config(tiny_dirs["llama"]).replace(model={"device": "auto"})
    with pytest.raises(ValueError, match="not resolved"):
        GPUWorker(config)


def test_device_gaps_merge_overlapping_kernels_and_split_short_from_long():
    from gpu_worker.tooling.step_profile import device_gaps

    empty = device_gaps([])
    assert (empty.busy, empty.span, empty.short_count, empty.long_count) == (0.0, 0.0, 0, 0)
    # [0, 4) and [2, 5) overlap; [7, 8) after a gap of 2; [7.5, 7.6) inside it; [8.5, 9)
    # after a short gap of 0.5 (with a limit of 1); [20, 21) after a long one of 11
    gaps = device_gaps(
        [(7.0, 8.0), (0.0, 4.0), (20.0, 21.0), (2.0, 5.0), (7.5, 7.6), (8.5, 9.0)], short=1.0
    )
    assert (gaps.busy, gaps.span) == (7.5, 21.0)
    assert (gaps.short_count, gaps.short_total) == (1, 0.5)
    assert (gaps.long_count, gaps.long_total) == (2, 13.0)
    # longest first, each with the start-order index of the interval after it
    assert gaps.longest == [(11.0, 5), (2.0, 2)]
    assert gaps.busy + gaps.short_total + gaps.long_total == gaps.span


def test_malformed_plans_are_refused_with_the_reason():
    from gpu_worker.step.plan_arrays import parse_plan

    good = extend_plan(1, [(1, 0, [5, 6], [8, 9], True), (2, 0, [7], [4], True)])
    assert parse_plan(good, 4).chunk_slots.tolist() == [8, 9, 4]
    cases = {
        "without slots": extend_plan(2, [(1, 0, [5, 6], [8], True)]),
        "appears twice": extend_plan(3, [(1, 0, [5], [8], True), (1, 1, [6], [9], True)]),
        "is invalid": decode_plan(4, [5]),
        "slot_lens do not match": ForwardPlan(
            5,
            "decode",
            codec.pack_ids([1]),
            codec.pack_ids([0]),
            codec.pack_ids([2]),
            codec.pack_ids([7]),
        ),
    }
    for reason, plan in cases.items():
        with pytest.raises(ValueError, match=reason):
            parse_plan(plan, 4)


def test_compiles_after_the_warm_up_are_logged(monkeypatch, caplog):
    knobs = pytest.importorskip("triton.knobs")  # Triton before 3.4 has no hook: no warning
    from gpu_worker.tooling.warm_up import watch_compiles

    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", None)
    built = []
    assert watch_compiles(on_build=lambda: built.append(1))
    hook = knobs.runtime.jit_post_compile_hook
    with caplog.at_level("WARNING", logger="gpu_worker.tooling.warm_up"):
        hook(
            key="k",
            repr="_extend_kernel[num_warps=4](q: *bf16)",
            fn=None,
            compile={},
            is_manual_warmup=False,
            already_compiled=False,
        )
    assert "_extend_kernel[num_warps=4]" in caplog.text and "warm-up" in caplog.text
    assert built == [1]  # a build is progress for the watchdog


def test_decode_step_variant_serves_every_row_of_a_batch(tiny_dirs):
    """Greedy batches without logprobs take the argmax graph; logprobs, sampling or penalties
    the sampling graph; a top-k or top-p row the one that sorts."""
    worker = GPUWorker(make_config(tiny_dirs["llama"]).replace(runner={"cuda_graph_max_bs": 4}))
    params = {
        1: SamplingParams(temperature=0.0),
        2: SamplingParams(temperature=0.8, seed=2),
        3: SamplingParams(temperature=0.0, presence_penalty=0.5),
        4: SamplingParams(temperature=0.8, top_p=0.9, seed=4),
    }
    for row, p in params.items():
        worker.sampling.start(row, p, [5, 6], 0)
    step = worker.decode_step
    assert step.variant_for(np.array([1]), want_logprobs=False) == "greedy"
    assert step.variant_for(np.array([1]), want_logprobs=True) == "sample"
    assert step.variant_for(np.array([1, 2]), want_logprobs=False) == "sample"
    assert step.variant_for(np.array([1, 3]), want_logprobs=False) == "sample"
    assert step.variant_for(np.array([1, 2, 4]), want_logprobs=False) == "filter"


@pytest.mark.parametrize("backend, captured", [("triton", True), ("torch_native", False)])
def test_graph_memory_is_budgeted_only_where_graphs_are_captured(tiny_dirs, backend, captured):
    """The target's spec reserves memory for the decode graphs, their sampling and the
    prefill graphs with a backend that can be captured, and none without one."""
    from gpu_worker.build import target_spec
    from gpu_worker.speculative.iteration import ACCEPT_GRAPH_ROWS

    config = make_config(tiny_dirs["llama"]).replace(
        runner={
            "attention_backend": backend,
            "cuda_graph_max_bs": 8,
            "cuda_graph_max_prefill_tokens": 256,
        }
    )
    spec = target_spec(config)
    reserved = (spec.graph_tokens, spec.graph_sampled_rows, spec.prefill_graph_tokens)
    assert reserved == ((8, 8, 256) if captured else (0, 0, 0))
    # speculation: the stage graphs' verify forwards and accept graphs, one row per tree node
    # (up to ACCEPT_GRAPH_ROWS of them), and adaptive speculation's plain decode step graphs
    for num_draft, rows in ((6, 48), (64, ACCEPT_GRAPH_ROWS)):
        for adaptive, plain_rows in (("off", 0), ("on", 8)):
            spec = target_spec(
                config.replace(
                    speculative={
                        "speculative_algorithm": "EAGLE",
                        "speculative_num_draft_tokens": num_draft,
                        "speculative_adaptive": adaptive,
                    }
                )
            )
            reserved = (spec.graph_tokens, spec.graph_sampled_rows)
            assert reserved == ((8 * num_draft, rows + plain_rows) if captured else (0, 0))
