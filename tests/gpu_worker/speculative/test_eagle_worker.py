"""The speculative GPU worker driven by the real scheduler core, in process (no sockets).

Greedy output with EAGLE / EAGLE-3 must equal the target's own greedy output token for token,
for chains and trees, page sizes 1 and 4 and small prefill chunks; a draft that
always agrees with its target is accepted in full (S+1 tokens per verify); the prefill rotation
takes the next prompt token as a non-final chunk's tail (SGLang #26329).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest
import torch

from aerie.codec import pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import SamplingParams, TokenizedRequest
from gpu_worker.speculative.eagle_worker import rotate_prefill_inputs
from gpu_worker.tooling.warm_up import draft_prefill_lengths, run_warm_up
from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler
from tests.devices import skip_unless_triton_runs_on
from tests.engine_loop import drive, outputs_of

# AERIE_SPEC_TEST_DEVICE=cuda runs these tests on the GPU, with the Triton backend and the
# speculative stages in CUDA graphs (`python3 -m benchmarks cuda-tests` does); CPU runs them
# directly.
DEVICE = os.environ.get("AERIE_SPEC_TEST_DEVICE", "cpu")
on_cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="checks the CPU memory budget")


def make_config(
    target,
    algorithm=None,
    draft=None,
    steps=None,
    topk=None,
    num_draft=None,
    page_size=1,
    chunk=64,
    backend=None,
    graph_max_bs=None,
    overlap=True,
    prefill_graphs=True,
) -> AerieConfig:
    """backend / graph_max_bs default to the device's: torch_native and no graphs on CPU,
    triton and graphs up to 8 requests on CUDA, where prefills of up to 32 tokens replay
    graphs too unless not prefill_graphs. overlap: two plans in flight (`drive`)."""
    if backend is None:
        backend = "torch_native" if DEVICE == "cpu" else "triton"
    if graph_max_bs is None and DEVICE == "cuda":
        graph_max_bs = 8
    prefill_tokens = 32 if DEVICE == "cuda" and prefill_graphs else 0
    return AerieConfig().replace(
        model={
            "model_path": target,
            "tokenizer_path": target,
            "device": DEVICE,
            "dtype": "float32",
            "load_format": "safetensors",
            "context_length": 256,
        },
        cache={"page_size": page_size, "max_total_tokens": 4096},
        scheduler={
            "max_running_requests": 8,
            "chunked_prefill_size": chunk,
            "disable_overlap_schedule": not overlap,
        },
        speculative={
            "speculative_algorithm": algorithm,
            "speculative_draft_model_path": draft,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": num_draft,
        },
        runner={
            "attention_backend": backend,
            "cuda_graph_max_bs": graph_max_bs,
            "cuda_graph_max_prefill_tokens": prefill_tokens,
        },
    )


def run_engine(
    config: AerieConfig,
    prompts: list[list[int]],
    max_new: int | list[int],
    warm_up: bool = False,
    sampling: SamplingParams | None = None,
):
    """Serve `prompts` to the end (max_new: for all, or per prompt), greedily or with
    `sampling` (request i seeded with i), after the start-up warm-up where `warm_up`;
    returns (outputs, verify counts, decode results)."""
    worker = GPUWorker(config)
    if warm_up:
        assert run_warm_up(worker) is not None
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    limits = max_new if isinstance(max_new, list) else [max_new] * len(prompts)
    for i, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        params = SamplingParams(max_new_tokens=limit, temperature=0.0, ignore_eos=True)
        if sampling is not None:
            params = dataclasses.replace(sampling, max_new_tokens=limit, seed=i, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params))
    outputs = {f"r{i}": [] for i in range(len(prompts))}
    verify_ct, decode_counts = {}, []

    def collect(plan, result, deltas):
        if plan.mode == "decode":
            decode_counts.extend(unpack_ids(result.num_tokens))
        for d in deltas:
            outputs[d.rid] += d.token_ids
            verify_ct[d.rid] = d.spec_verify_ct

    drive(sched, worker, collect)
    return outputs, verify_ct, decode_counts


def random_prompts(seed: int, n: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 320) for _ in range(rng.randint(2, 30))] for _ in range(n)]


@pytest.mark.parametrize(
    "algorithm, steps, topk, num_draft, page_size, chunk",
    [
        ("EAGLE", 3, 1, 4, 1, 64),
        ("EAGLE", 3, 2, 6, 4, 4),
        ("EAGLE", 2, 4, 8, 1, 16),
        ("EAGLE3", 3, 1, 4, 4, 4),
        ("EAGLE3", 3, 2, 5, 1, 64),
    ],
)
def test_greedy_speculative_output_equals_target_greedy(
    models, algorithm, steps, topk, num_draft, page_size, chunk
):
    """With the overlap schedule (two plans in flight) and without; the plain baseline runs
    without it, and on CUDA with eager prefills (the others replay prefill graphs)."""
    prompts = random_prompts(seed=steps * 10 + topk)
    base_config = make_config(
        models["target"], page_size=page_size, overlap=False, prefill_graphs=False
    )
    base, _, _ = run_engine(base_config, prompts, 20)
    draft = models["eagle" if algorithm == "EAGLE" else "eagle3"]
    for overlap in (True, False):
        config = make_config(
            models["target"],
            algorithm,
            draft,
            steps,
            topk,
            num_draft,
            page_size,
            chunk,
            overlap=overlap,
        )
        spec, verify_ct, counts = run_engine(config, prompts, 20)
        assert spec == base, f"overlap={overlap}"
        assert all(1 <= n <= steps + 1 for n in counts)
        assert all(v > 0 for v in verify_ct.values())
    assert run_engine(make_config(models["target"], page_size=page_size), prompts, 20)[0] == base


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_start_up_warm_up_leaves_no_trace(models, algorithm):
    """The warm-up's dummy prefills (rows 1-2, the first KV slots, the draft's prefill too)
    change nothing the requests served after it see."""
    prompts = random_prompts(seed=5)
    base, _, _ = run_engine(make_config(models["target"], overlap=False), prompts, 12)
    draft = models["eagle" if algorithm == "EAGLE" else "eagle3"]
    config = make_config(models["target"], algorithm, draft, 3, 2, 5, page_size=4)
    assert run_engine(config, prompts, 12, warm_up=True)[0] == base


def test_warm_up_covers_each_draft_prefill_length_of_the_few_query_kernel(models):
    """With a draft on the triton backend the warm-up adds one prefill per chunk length the
    few-query kernel takes (a constexpr of it); with torch_native, none."""
    skip_unless_triton_runs_on("cpu")
    for backend in ("triton", "torch_native"):
        config = make_config(models["target"], "EAGLE", models["eagle"], 3, 1, 4, backend=backend)
        worker = GPUWorker(config)
        attn = worker.draft_runner_list[0].attn_backend
        group = attn.num_heads // attn.num_kv_heads if backend == "triton" else 0
        want = list(range(1, 64 // group + 1)) if group else []
        assert draft_prefill_lengths(worker) == want


TRITON_CASES = [("EAGLE", 4, 2, 6), ("EAGLE3", 1, 2, 6), ("EAGLE3", 1, 1, 4)]  # the last a chain


@pytest.mark.parametrize("algorithm, page_size, topk, num_draft", TRITON_CASES)
def test_triton_backend_gives_the_same_speculative_output(
    models, monkeypatch, algorithm, page_size, topk, num_draft
):
    """Draft decode (branch-local keys), tree verify, greedy acceptance and draft extend in
    the Triton kernels (interpreter on CPU): the same tokens and accept lengths as the
    torch_native reference. The EAGLE-3 draft layer runs its own Triton path
    (`Eagle3DecoderLayer._forward_triton`); acceptance writes the extend stage's inputs; a
    chain's draft steps and the greedy verify take the fused LM head and argmax."""
    from gpu_worker import model_runner
    from gpu_worker.models.llama_eagle3 import Eagle3DecoderLayer
    from gpu_worker.speculative import iteration

    skip_unless_triton_runs_on("cpu")
    calls = []  # one entry per run of the EAGLE-3 layer's Triton path
    forward = Eagle3DecoderLayer._forward_triton
    monkeypatch.setattr(
        Eagle3DecoderLayer, "_forward_triton", lambda *args: calls.append(1) or forward(*args)
    )
    in_place = []  # per fused acceptance: whether it was given the extend stage's buffers
    accept = iteration.greedy_accept
    monkeypatch.setattr(
        iteration, "greedy_accept", lambda *a: in_place.append(a[3] is not None) or accept(*a)
    )
    heads = []  # the vocabulary size of each fused LM head + argmax
    head = model_runner.greedy_head.greedy_head
    monkeypatch.setattr(
        model_runner.greedy_head,
        "greedy_head",
        lambda x, w, *a: heads.append(w.shape[0]) or head(x, w, *a),
    )
    prompts = random_prompts(seed=3, n=3)
    draft = models["eagle" if algorithm == "EAGLE" else "eagle3"]
    runs = []
    for backend in ("torch_native", "triton"):
        # Stage buffers for 4 requests (graphs where they can be captured): 3 run, 1 padded.
        config = make_config(
            models["target"],
            algorithm,
            draft,
            3,
            topk,
            num_draft,
            page_size,
            8,
            backend=backend,
            graph_max_bs=4,
        )
        runs.append(run_engine(config, prompts, 8))  # the interpreter takes seconds a step
        if backend == "torch_native":
            assert not calls and not in_place and not heads
    assert runs[0] == runs[1]
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    draft_vocab = config.get("draft_vocab_size", config["vocab_size"])
    assert config["vocab_size"] in heads  # the verify of a greedy batch
    if algorithm == "EAGLE3":  # a vocabulary of its own: seen where a chain's draft steps ran
        assert draft_vocab < config["vocab_size"]
        assert (draft_vocab in heads) == (topk == 1)
    assert bool(calls) == (algorithm == "EAGLE3")
    assert in_place and all(in_place)


@pytest.mark.parametrize("topk, num_draft", [(1, 4), (3, 7)])
def test_agreeing_draft_is_accepted_in_full(models, topk, num_draft):
    steps = 3
    config = make_config(models["bigram"], "EAGLE", models["agreeing"], steps, topk, num_draft)
    prompts = random_prompts(seed=5)
    outputs, verify_ct, counts = run_engine(config, prompts, 1 + 4 * (steps + 1))
    assert counts and all(n == steps + 1 for n in counts)
    assert all(v == 4 for v in verify_ct.values())
    base, _, _ = run_engine(make_config(models["bigram"]), prompts, 1 + 4 * (steps + 1))
    assert outputs == base


def test_verify_counts_do_not_depend_on_prefill_chunking(models):
    """SGLang #26329: with a wrong tail at chunk boundaries the draft KV there is computed from
    the wrong token, acceptance changes, and so do the per-request verify counts."""
    prompts = random_prompts(seed=11)
    runs = []
    for chunk in (3, 64):
        config = make_config(models["target"], "EAGLE", models["eagle"], 3, 1, 4, chunk=chunk)
        runs.append(run_engine(config, prompts, 16)[:2])
    assert runs[0] == runs[1]


def draft_kv_after_prefill(models, chunk: int, prompt: list[int]) -> torch.Tensor:
    """The draft pool's layer-0 K at the prompt's positions after prefilling it (max_new 1)."""
    config = make_config(models["target"], "EAGLE", models["eagle"], 3, 1, 4, chunk=chunk)
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    params = SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True)
    sched.add_request(TokenizedRequest("r", pack_ids(prompt), params))
    slots: list[int] = []
    while sched.has_work():
        plan = sched.next_plan()
        slots += unpack_ids(plan.slots)
        sched.apply_result(plan, worker.execute(plan))
    assert len(slots) == len(prompt)
    k, _ = worker.draft_runner_list[0].kv_pool.get_kv(0)
    return k[torch.tensor(slots)].clone()


def serve(
    sched: Scheduler, worker: GPUWorker, prompt: list[int], max_new: int
) -> tuple[int, list[int], int]:
    """One greedy request run alone to its end: (its row, its output, its cached tokens)."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    sched.add_request(TokenizedRequest(f"r{len(prompt)}", pack_ids(prompt), params))
    row, output, cached = 0, [], 0
    while sched.has_work():
        plan = sched.next_plan()
        row = unpack_ids(plan.rows)[0]
        for d in outputs_of(sched.apply_result(plan, worker.execute(plan))):
            output += d.token_ids
            cached = d.cached_tokens
    return row, output, cached


@pytest.mark.parametrize("algorithm, page_size", [("EAGLE", 1), ("EAGLE3", 4)])
def test_a_cached_prefix_leaves_the_drafts_kv_as_a_full_prefill_makes_it(
    models, algorithm, page_size
):
    """A second turn reuses the first turn's cached KV, one token short of the match (the
    draft's KV at a position was made with the next token) and in whole pages: afterwards
    the draft's KV at every position whose next token is known equals a one-shot prefill's."""
    draft = models["eagle" if algorithm == "EAGLE" else "eagle3"]
    config = make_config(models["target"], algorithm, draft, 3, 1, 4, page_size, chunk=5)
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    first = random_prompts(seed=23, n=1)[0] + list(range(40, 50))
    _, answer, cached = serve(sched, worker, first, 12)
    assert cached == 0
    # Diverge right after the cached tokens: the draft's KV at the last cached position was
    # made with the first turn's next token, not this one.
    second = first + answer[:-1] + [answer[-1] + 1, 8, 9]
    row, output, cached = serve(sched, worker, second, 6)
    matched = (len(first) + len(answer) - 1) // page_size * page_size
    assert cached == (matched - 1) // page_size * page_size
    sequence = second + output
    m = len(sequence) - 1  # positions 0..m-1 have their next token in `sequence`
    uncached = config.replace(
        cache={"disable_radix_cache": True}, scheduler={"chunked_prefill_size": 64}
    )
    reference = GPUWorker(uncached)
    ref_sched = Scheduler(uncached, (), max_total_tokens=reference.runner.max_total_tokens)
    ref_row, _, _ = serve(ref_sched, reference, sequence[:m], 1)

    def draft_kv(w: GPUWorker, r: int) -> torch.Tensor:
        runner = w.draft_runner_list[0]
        return runner.kv_pool.get_kv(0)[0][runner.req_to_token_pool.req_to_token[r, :m].long()]

    got, want = draft_kv(worker, row), draft_kv(reference, ref_row)
    torch.testing.assert_close(got[: m - 1], want[: m - 1], atol=1e-5, rtol=1e-5)


def test_chunk_boundary_tail_token(models):
    """SGLang #26329: a non-final chunk's tail is the next prompt token, not the target's
    (meaningless) sample at a mid-prompt position; chunked and one-shot prefill then give the
    draft the same KV at every prompt position, chunk boundaries included."""
    prompt = random_prompts(seed=3, n=1)[0] + [7, 8, 9, 10, 11, 12, 13]
    one_shot = draft_kv_after_prefill(models, 64, prompt)
    chunked = draft_kv_after_prefill(models, 3, prompt)
    torch.testing.assert_close(chunked, one_shot, atol=1e-5, rtol=1e-5)


def test_rotation_chunked_prefill():
    """Each chunk shifts left by one and ends with its tail (next prompt token or sampled)."""
    ids = torch.tensor([10, 11, 12, 20, 21, 30])
    rotated = rotate_prefill_inputs(ids, torch.tensor([3, 2, 1]), torch.tensor([13, 99, 31]))
    assert rotated.tolist() == [11, 12, 13, 21, 99, 31]


@on_cpu_only
def test_memory_sized_kv_pools_fit_the_budget_with_a_draft(models, monkeypatch):
    """The draft's pool has the target's slot count, so a memory-sized target pool must leave
    room for it (a shallow target with a one-layer draft needs 1.5x the target's KV alone)."""
    import gpu_worker.model_runner as model_runner

    budget = 1 << 20
    monkeypatch.setattr(model_runner, "CPU_KV_BUDGET_BYTES", budget)
    config = make_config(models["target"], "EAGLE", models["eagle"], 3, 1, 4)
    worker = GPUWorker(config.replace(cache={"max_total_tokens": None}))
    pools = [runner.kv_pool for runner in worker.runners]
    used = sum(sum(t.numel() * t.element_size() for t in p.k_buffers + p.v_buffers) for p in pools)
    assert used <= budget * 1.01  # + the reserved dummy page
    assert worker.runner.max_total_tokens == worker.draft_runner_list[0].max_total_tokens > 0


def test_draft_positions(models, monkeypatch):
    """SGLang #25015: draft step i of a request with committed length seq runs at position
    seq + i (step 0 at seq, not seq + 1), writes the slots `draft_cache_locs` gives for step i
    (the one owner of the layout), and the loop leaves its inputs unmodified."""
    from gpu_worker.speculative import draft_layout

    # Direct stages: the spies below see what runs (a graph replay runs no Python).
    config = make_config(models["target"], "EAGLE", models["eagle"], 4, 2, 8, graph_max_bs=0)
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    for i, prompt in enumerate(random_prompts(seed=2, n=3)):
        params = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params))
    seen = []
    original_forward = worker.draft_runner_list[0].forward

    def spy(batch):
        if batch.mode.name == "DRAFT_DECODE":
            seen.append((batch.positions.clone(), batch.out_cache_loc.clone()))
        return original_forward(batch)

    monkeypatch.setattr(worker.draft_runner_list[0], "forward", spy)
    original_tree = worker.spec.draft_tree
    checked = []

    def tree_spy(rows, committed_lens, seq_cpu, bonus, coupled=False):
        seen.clear()
        before = committed_lens.clone()
        tree = original_tree(rows, committed_lens, seq_cpu, bonus, coupled)
        assert torch.equal(committed_lens, before)
        locs = draft_layout.draft_cache_locs(
            worker.draft_runner_list[0].req_to_token_pool.req_to_token, rows, committed_lens, 2, 4
        )
        assert len(seen) == 3  # S - 1 forwards
        for step, (positions, slots) in enumerate(seen):
            assert positions.tolist() == (committed_lens.repeat_interleave(2) + step).tolist()
            assert torch.equal(slots, locs[step])
        checked.append(True)
        return tree

    monkeypatch.setattr(worker.spec, "draft_tree", tree_spy)
    drive(sched, worker)
    assert checked


def test_stop_token_inside_an_accepted_run(models):
    """A stop token accepted in the middle of a verified run ends the request there; the
    tokens after it are dropped and every KV slot comes back."""
    steps, prompt = 3, [21, 22, 23]
    config = make_config(models["bigram"], "EAGLE", models["agreeing"], steps, 1, 4)
    full, _, counts = run_engine(config, [prompt], 1 + 2 * (steps + 1))
    assert counts[0] == steps + 1  # the first verify accepts a whole run
    stop = full["r0"][2]  # inside the first verified run (token 0 comes from prefill)
    assert stop not in full["r0"][:2]
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    params = SamplingParams(max_new_tokens=20, temperature=0.0, stop_token_ids=[stop])
    sched.add_request(TokenizedRequest("r", pack_ids(prompt), params))
    out, finishes = [], []

    def collect(plan, result, deltas):
        for d in deltas:
            out.extend(d.token_ids)
            if d.finish is not None:
                finishes.append(d.finish)

    drive(sched, worker, collect)
    assert out == full["r0"][:3] and len(finishes) == 1
    assert finishes[0].type == "stop" and finishes[0].matched == stop


def test_logprobs_with_speculation_equal_plain_decoding(models):
    """Greedy logprobs of the emitted tokens come from the verify logits at accepted nodes and
    equal plain decoding's."""
    prompts = random_prompts(seed=8, n=3)

    def logprobs_of(config):
        worker = GPUWorker(config)
        sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
            sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params, True))
        got = {f"r{i}": [] for i in range(len(prompts))}

        def collect(plan, result, deltas):
            for d in deltas:
                got[d.rid] += d.logprobs

        drive(sched, worker, collect)
        return got

    plain = logprobs_of(make_config(models["target"]))
    spec = logprobs_of(make_config(models["target"], "EAGLE", models["eagle"], 3, 2, 6))
    for rid in plain:
        assert len(spec[rid]) == len(plain[rid]) == 10
        torch.testing.assert_close(
            torch.tensor(spec[rid]), torch.tensor(plain[rid]), atol=1e-4, rtol=1e-4
        )


def test_greedy_with_penalties_equals_plain_decoding(models):
    """Penalties change the target's choices as tokens are emitted; a node deep in an accepted
    run must see the drafts before it as emitted (a confident draft accepts long runs)."""
    prompts = random_prompts(seed=9, n=4)

    def outputs(config):
        worker = GPUWorker(config)
        sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(
                max_new_tokens=24,
                temperature=0.0,
                ignore_eos=True,
                frequency_penalty=0.7,
                repetition_penalty=1.3,
            )
            sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt), params))
        got = {f"r{i}": [] for i in range(len(prompts))}

        def collect(plan, result, deltas):
            for d in deltas:
                got[d.rid] += d.token_ids

        drive(sched, worker, collect)
        return got

    plain = outputs(make_config(models["bigram"]))
    for topk, num_draft in ((1, 4), (3, 7)):
        config = make_config(models["bigram"], "EAGLE", models["agreeing"], 3, topk, num_draft)
        assert outputs(config) == plain


@pytest.mark.parametrize("graph_max_bs", [0, 4])
def test_a_chain_couples_its_sampled_proposals_to_the_targets_draws(models, graph_max_bs):
    """A draft whose distribution is the target's proposes, for sampled requests, the very
    tokens the target draws (`EagleWorker.coupled_noise`): at T = 1 over a nearly flat
    distribution (a plain argmax proposal would be accepted about 1% of the time) almost
    every draft is accepted, and the output stays the plain engine's seeded draws."""
    sampling = SamplingParams(temperature=1.0)
    prompts = random_prompts(seed=4, n=3)
    plain, _, _ = run_engine(make_config(models["bigram"]), prompts, 24, sampling=sampling)
    config = make_config(
        models["bigram"], "EAGLE", models["matching"], 3, 1, 4, graph_max_bs=graph_max_bs
    )
    outputs, _, counts = run_engine(config, prompts, 24, sampling=sampling)
    assert outputs == plain
    assert sum(counts) / len(counts) > 3.0  # of at most 4
