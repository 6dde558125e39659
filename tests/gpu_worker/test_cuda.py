"""The same runner on CUDA: matches HF (float32) and stays close in bfloat16; a
Llama-3.1-8B-shaped dummy model sizes its KV pool from free memory. Skipped without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from gpu_worker.model_runner import ModelRunner
from gpu_worker.step.forward_batch import ForwardMode
from tests.gpu_worker.checkpoints import reference_logits
from tests.gpu_worker.models.test_config import LLAMA_31_8B
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def decode_after_prefill(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Prefill ids[:-1] in chunks of 3, decode the last one; logits of the last [V]."""
    slots = shuffled_slots(runner, 1, len(ids))
    for start in range(0, len(ids) - 1, 3):
        piece = ids[start : min(start + 3, len(ids) - 1)]
        run_step(runner, ForwardMode.EXTEND, [1], [start], [piece], slots)
    out = run_step(runner, ForwardMode.DECODE, [1], [len(ids) - 1], [ids[-1:]], slots)
    return out.next_token_logits[0].cpu()


@pytest.mark.parametrize("backend", ["torch_native", "triton"])
@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_cuda_matches_hf(tiny_dirs, reference_models, name, backend):
    ids = list(range(3, 50, 2))
    expected = reference_logits(reference_models(name), ids)[-1]
    options = dict(
        page_size=4,
        max_total_tokens=256,
        max_running_requests=2,
        context_length=64,
        attention_backend=backend,
    )
    fp32 = runner_from_options(tiny_dirs[name], device="cuda", **options)
    torch.testing.assert_close(decode_after_prefill(fp32, ids), expected, atol=1e-3, rtol=0)
    bf16 = runner_from_options(tiny_dirs[name], device="cuda", dtype=torch.bfloat16, **options)
    assert bf16.kv_pool.k_buffers[0].dtype == torch.bfloat16
    torch.testing.assert_close(decode_after_prefill(bf16, ids), expected, atol=0.1, rtol=0)


@pytest.mark.slow
def test_llama31_8b_dummy_sizes_kv_from_free_memory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_31_8B))
    runner = runner_from_options(
        str(tmp_path),
        device="cuda",
        dtype=torch.bfloat16,
        load_format="dummy",
        page_size=16,
        max_running_requests=8,
        context_length=4096,
    )
    total = torch.cuda.mem_get_info()[1]
    kv_bytes = runner.max_total_tokens * runner.kv_pool.bytes_per_token()
    assert runner.max_total_tokens % 16 == 0 and kv_bytes > 0
    assert torch.cuda.memory_allocated() < 0.86 * total
    ids = list(range(100, 140))
    logits = decode_after_prefill(runner, ids)
    assert logits.shape == (128256,) and torch.isfinite(logits).all()
    print(f"KV pool: {runner.max_total_tokens} tokens, {kv_bytes / 2**30:.1f} GiB")


def test_a_graphed_decode_step_never_synchronises_the_host(tiny_dirs):
    """The worker's plain decode step (slot writes, graph replay, sampling) and an extend step
    that starts a request run under torch.cuda.set_sync_debug_mode("error"), with two steps in
    flight: no .item(), .cpu(), .tolist() or pageable copy; the one wait is the event of each
    step's copy of its results."""
    from aerie.codec import pack_ids
    from aerie.config import AerieConfig
    from aerie.messages import RequestStart, SamplingParams
    from aerie.plans import decode_plan, extend_plan, slot_columns
    from gpu_worker.worker import GPUWorker

    config = AerieConfig().replace(
        model={"model_path": tiny_dirs["llama"], "device": "cuda", "dtype": "float32"},
        cache={"max_total_tokens": 64, "page_size": 1},
        scheduler={"max_running_requests": 4},
        runner={
            "attention_backend": "triton",
            "cuda_graph_max_bs": 4,
            "cuda_graph_max_prefill_tokens": 16,
        },
    )
    worker = GPUWorker(config)
    assert all(stage.graphs for stage in worker.decode_step.stages.values())  # captured
    assert worker.prefill_graphs is not None and worker.prefill_graphs.stage.graphs  # prefills
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_p=0.9, seed=3)
    start = RequestStart(1, params, True, pack_ids([5, 6, 7]))
    prefill = extend_plan(1, [(1, 0, [5, 6, 7], [1, 2, 3], True)], [start])
    worker.execute(prefill)
    # A new request with penalties, prefilled while a decode step is in flight: its sampling
    # state goes over without waiting for the device either.
    penalized = SamplingParams(
        max_new_tokens=8, frequency_penalty=0.5, repetition_penalty=1.2, seed=4
    )
    second = RequestStart(2, penalized, False, pack_ids([8, 9]))
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = []
        for step in range(3):  # two steps in flight, like the overlap schedule
            launched.append(
                worker.launch(decode_plan(2 + step, [1], *slot_columns([(3 + step, [4 + step])])))
            )
            if step == 1:
                launched.append(
                    worker.launch(extend_plan(9, [(2, 0, [8, 9], [10, 11], True)], [second]))
                )
            while len(launched) >= 2:
                codec_first(worker.finish(launched.pop(0)))
        codec_first(worker.finish(launched.pop(0)))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def codec_first(result) -> int:
    from aerie.codec import unpack_ids

    return unpack_ids(result.token_ids)[0]


def test_sampled_decode_graphs_give_the_direct_steps_tokens(tiny_dirs):
    """Decode steps replayed as graphs (the greedy, sampling and sorting variants) emit the
    tokens and logprobs of the same steps run directly, for greedy rows that want logprobs,
    seeded sampled rows with top-p and top-k, and penalised rows."""
    from aerie.codec import pack_ids, unpack_floats, unpack_ids
    from aerie.config import AerieConfig
    from aerie.messages import RequestStart, SamplingParams
    from aerie.plans import decode_plan, extend_plan, slot_columns
    from gpu_worker.worker import GPUWorker

    params = [
        SamplingParams(max_new_tokens=16, temperature=0.0),
        SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(max_new_tokens=16, temperature=1.2, top_k=20, seed=4),
        SamplingParams(
            max_new_tokens=16,
            temperature=0.9,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
            seed=5,
        ),
    ]
    prompts = [[5, 6, 7], [9, 8, 7, 6], [11, 12], [4, 4, 4, 5]]
    outputs = []
    for graph_max_bs in (4, 0):
        config = AerieConfig().replace(
            model={"model_path": tiny_dirs["llama"], "device": "cuda", "dtype": "float32"},
            cache={"max_total_tokens": 256, "page_size": 1},
            scheduler={"max_running_requests": 4},
            runner={"attention_backend": "triton", "cuda_graph_max_bs": graph_max_bs},
        )
        worker = GPUWorker(config)
        seen = []
        # every variant: sample (logprobs; penalties), filter, then all rows together
        for batch in ([0], [3], [0, 1], [1, 2, 3], [0, 1, 2, 3]):
            starts = [RequestStart(i + 1, params[i], i == 0, pack_ids(prompts[i])) for i in batch]
            chunks = [
                (i + 1, 0, prompts[i], [64 * i + 1 + j for j in range(len(prompts[i]))], True)
                for i in batch
            ]
            result = worker.execute(extend_plan(1, chunks, starts))
            lengths = {i: len(prompts[i]) for i in batch}
            for step in range(6):
                new = [(lengths[i], [64 * i + 1 + lengths[i]]) for i in batch]
                result = worker.execute(
                    decode_plan(2 + step, [i + 1 for i in batch], *slot_columns(new))
                )
                seen.append((unpack_ids(result.token_ids), unpack_floats(result.logprobs)))
                for i in batch:
                    lengths[i] += 1
        outputs.append(seen)
    graphed, direct = outputs
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, direct, strict=True):
        assert tokens == want_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(want_logprobs), atol=1e-4, rtol=1e-4
        )


def test_step_clock_sees_the_device_wait_for_a_late_launch():
    """StepClock's gap is the device's idle time between steps: a step launched 20 ms after
    the previous one ended shows a gap of about that; one queued behind it shows none."""
    import time

    from gpu_worker.tooling.step_profile import StepClock

    clock, x = StepClock(), torch.ones(256, 256, device="cuda")
    x @ x  # the library's first call sets up on the host, longer than a step's device time
    torch.cuda.synchronize()
    for plan_id in (1, 2):
        clock.begin(plan_id)
        torch.cuda._sleep(10_000_000)  # milliseconds of device time: the host keeps ahead
        x = x @ x
        clock.end(plan_id)
    first_gap, first_span = clock.finished(1)
    gap, span = clock.finished(2)  # queued while step 1 ran: no wait
    assert first_gap is None and first_span > 100 and span > 100
    assert gap < 50
    torch.cuda.synchronize()
    time.sleep(0.02)  # the device is idle; the host launches late
    clock.begin(3)
    x = x @ x
    clock.end(3)
    gap, _ = clock.finished(3)
    assert 15_000 < gap < 60_000


@pytest.mark.parametrize("name", ["llama31", "qwen3"])
def test_pdl_graphs_give_the_logits_of_plain_launches_bit_for_bit(tiny_dirs, monkeypatch, name):
    """Batch-1 decode steps replayed as CUDA graphs whose kernels launch with programmatic
    dependent launch (`kernels.pdl`: each starts while the one before runs and waits for it
    before reading) give exactly the logits of the same graphs captured with plain launches.
    A kernel that read its input before its wait would race with the kernel writing it."""
    from gpu_worker.kernels import pdl
    from gpu_worker.step.host_batch import HostBatch

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs compute capability 9.0")
    steps = []
    for plain in (True, False):
        monkeypatch.setattr(pdl, "FORCE_OFF", plain)
        runner = runner_from_options(
            tiny_dirs[name],
            device="cuda",
            dtype=torch.bfloat16,
            attention_backend="triton",
            cuda_graph_max_bs=1,
            page_size=1,
            max_total_tokens=256,
            max_running_requests=2,
            context_length=128,
        )
        assert runner.decode_graphs is not None and runner.decode_graphs.graphs
        ids = list(range(3, 40, 3))
        slots = shuffled_slots(runner, 1, 100)
        run_step(runner, ForwardMode.EXTEND, [1], [0], [ids[:-1]], slots)
        logits, token, length = [], ids[-1], len(ids) - 1
        for _ in range(24):
            runner.req_to_token_pool.write(
                *(torch.tensor(v, device="cuda") for v in ([1], [length], [slots[0][length]], [1]))
            )
            host = HostBatch.from_requests(
                ForwardMode.DECODE, [[token]], [length], [[slots[0][length]]], [1]
            )
            out = runner.forward_host(host).next_token_logits[0].float().cpu()
            logits.append(out)
            token, length = int(out.argmax()), length + 1
        steps.append(torch.stack(logits))
    torch.testing.assert_close(steps[1], steps[0], atol=0, rtol=0)


def test_graph_trace_records_a_graph_launch_as_one_interval_as_long_as_its_run():
    """GraphTrace (CUPTI, graph-level), started before the graph is captured, gives one record
    per replay of a graph of 40 kernels from its window on, not one per kernel, together as
    long as the replays measured by CUDA events; the kernel and copy launched outside the
    graph get a record each, and the warm-up before the window none."""
    from gpu_worker.tooling.cupti_trace import GraphTrace
    from gpu_worker.tooling.step_profile import device_gaps

    trace = GraphTrace()
    trace.start()
    try:
        x, w = torch.randn(64, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda") / 32
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                y = x
                for _ in range(20):
                    y = torch.tanh(y @ w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x
            for _ in range(20):
                y = torch.tanh(y @ w)
        torch.cuda.synchronize()
        trace.window()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            graph.replay()
        end.record()
        z = x @ w  # one kernel outside the graph
        torch.empty(64, 1024, pin_memory=True).copy_(z, non_blocking=True)
        torch.cuda.synchronize()
    finally:
        intervals, records = trace.stop()
    print(records)
    assert records["graph"] == 5
    # The eager matmul and copy (2 kernel records on the H100): none of the 200 graph nodes,
    # none of the 40 warm-up kernels before the window.
    assert 1 <= records.get("kernel", 0) <= 3
    assert records.get("memcpy", 0) == 1 and records.get("dropped", 0) == 0
    busy = device_gaps(intervals).busy
    elapsed_us = 1e3 * start.elapsed_time(end)
    assert 0.8 * elapsed_us < busy < 1.2 * elapsed_us + 200  # the replays, then two small ops
