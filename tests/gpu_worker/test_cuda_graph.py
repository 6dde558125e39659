"""A runner's graphed decode forward: buckets, padding to row 0 / slot 0, static buffers.

On CPU the same buffers, padding and copies run eagerly (what CI covers); on CUDA the graphs
are captured and replayed, and must give what the eager forward gives."""

from __future__ import annotations

import pytest
import torch

from gpu_worker.graphs.capture import batch_size_buckets
from gpu_worker.model_runner import ModelRunner
from gpu_worker.step.forward_batch import ForwardMode
from gpu_worker.step.host_batch import HostBatch
from tests.devices import skip_unless_triton_runs_on
from tests.gpu_worker.runner_utils import run_step, runner_from_options, shuffled_slots


def devices():
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def test_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(6) == [1, 2, 4, 6]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(32)[-3:] == [16, 24, 32]


def make_runner(model_dir: str, device: str, graph_max_bs: int, backend: str) -> ModelRunner:
    if backend == "triton":
        skip_unless_triton_runs_on(device)
    return runner_from_options(
        model_dir,
        device=device,
        page_size=4,
        max_total_tokens=512,
        max_running_requests=8,
        context_length=64,
        attention_backend=backend,
        cuda_graph_max_bs=graph_max_bs,
    )


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("backend", ["torch_native", "triton"])
def test_graph_path_gives_the_eager_logits_and_touches_only_its_slots(tiny_dirs, device, backend):
    if device == "cuda" and backend == "torch_native":
        pytest.skip("torch_native decode is eager-only on CUDA")
    graphed = make_runner(tiny_dirs["qwen3"], device, 6, backend)
    eager = make_runner(tiny_dirs["qwen3"], device, 0, backend)
    assert graphed.decode_graphs is not None and eager.decode_graphs is None
    assert bool(graphed.decode_graphs.graphs) == (device == "cuda")
    prompts = [[5, 6, 7, 8, 9], [3] * 11, [40, 41], [7] * 17, [9, 8], [1, 2, 3]]
    slots = shuffled_slots(graphed, len(prompts), 24, seed=1)
    for runner in (graphed, eager):  # the same prefixes in both pools
        run_step(runner, ForwardMode.EXTEND, list(range(1, 7)), [0] * 6, prompts, slots)
    for bs in (1, 3, 5, 6):  # buckets 1, 4, 6 (3 and 5 padded)
        rows = list(range(1, bs + 1))
        ids = [[11 + r] for r in rows]
        prefix = [len(prompts[r - 1]) for r in rows]
        new_slots = [[slots[r - 1][p]] for r, p in zip(rows, prefix, strict=True)]
        host = HostBatch.from_requests(ForwardMode.DECODE, ids, prefix, new_slots, rows)
        before = graphed.kv_pool.get_kv(0)[0].clone()
        for runner in (graphed, eager):
            runner.req_to_token_pool.write(
                torch.tensor(rows, device=device),
                torch.tensor(prefix, device=device),
                torch.tensor([s[0] for s in new_slots], device=device),
                torch.ones(bs, dtype=torch.int64, device=device),
            )
        # Token ids fed back on the device (as the training generator does) or from the host.
        fed = torch.tensor([i[0] for i in ids], device=device) if bs % 2 else None
        zeros = HostBatch.from_requests(ForwardMode.DECODE, [[0]] * bs, prefix, new_slots, rows)
        out = graphed.forward_host(host if fed is None else zeros, input_ids=fed)
        ref = eager.forward_host(host)
        assert out.next_token_logits.shape == ref.next_token_logits.shape == (bs, 256)
        torch.testing.assert_close(
            out.next_token_logits, ref.next_token_logits, atol=1e-5, rtol=1e-5
        )
        changed = (graphed.kv_pool.get_kv(0)[0] != before).flatten(1).any(dim=1)
        written = {s[0] for s in new_slots} | {0}  # padded rows write the dummy slot only
        assert set(torch.nonzero(changed).flatten().tolist()) <= written
        for r, p in zip(rows, prefix, strict=True):  # the next step's keys
            prompts[r - 1] = prompts[r - 1] + [11 + r]
            assert len(prompts[r - 1]) == p + 1


@pytest.mark.parametrize("device", devices())
def test_batches_beyond_the_largest_bucket_run_eagerly(tiny_dirs, device):
    runner = make_runner(tiny_dirs["llama"], device, 2, "triton")
    rows = [1, 2, 3]
    host = HostBatch.from_requests(
        ForwardMode.DECODE, [[5], [6], [7]], [0, 0, 0], [[4], [8], [12]], rows
    )
    assert runner.decode_graphs.capacity(len(rows)) is None  # runs unpadded
    assert runner.forward_host(host).next_token_logits.shape == (3, 256)


def test_capture_buckets_warms_up_then_captures_each_bucket_largest_first(monkeypatch):
    """The capture loop every graph owner shares, with torch.cuda replaced by a recorder (CPU
    has no graphs): per bucket, largest first, the eager warm-up runs on the capture stream
    and then one run inside a capture into the shared pool."""
    import contextlib
    from types import SimpleNamespace

    from gpu_worker.graphs import capture as cuda_graph

    events = []

    @contextlib.contextmanager
    def graph(g, pool, stream):
        events.append(("capture", pool))
        yield
        events.append(("captured", pool))

    @contextlib.contextmanager
    def on_stream(stream):
        yield

    fake = SimpleNamespace(
        memory_reserved=lambda device: 0,
        graph_pool_handle=lambda: "new pool",
        Stream=lambda device: SimpleNamespace(wait_stream=lambda other: None),
        current_stream=lambda: SimpleNamespace(wait_stream=lambda other: None),
        stream=on_stream,
        CUDAGraph=object,
        graph=graph,
        synchronize=lambda device: None,
    )
    monkeypatch.setattr(cuda_graph.torch, "cuda", fake)
    graphs = cuda_graph.capture_buckets(
        [1, 2, 4], lambda b: events.append(("run", b)), "cpu", "test, batch sizes", pool="shared"
    )
    assert sorted(graphs) == [1, 2, 4]
    warm = [("run", 4)] * cuda_graph.NUM_WARMUP_RUNS
    assert events[: len(warm) + 3] == [
        *warm,
        ("capture", "shared"),
        ("run", 4),
        ("captured", "shared"),
    ]
    runs = [b for kind, b in events if kind == "run"]
    assert runs == [b for b in (4, 2, 1) for _ in range(cuda_graph.NUM_WARMUP_RUNS + 1)]


def test_captures_run_without_garbage_collection(monkeypatch):
    """The cyclic collector is off inside every capture (it would destroy unreachable graphs
    there, which invalidates the capture) and back on outside: warm-ups and afterwards."""
    import contextlib
    import gc
    from types import SimpleNamespace

    from gpu_worker.graphs import capture as cuda_graph

    state = {"capturing": False}
    seen = []

    @contextlib.contextmanager
    def graph(g, pool, stream):
        seen.append(("begin", gc.isenabled()))  # the capture begins on entry
        state["capturing"] = True
        yield
        state["capturing"] = False

    fake = SimpleNamespace(
        memory_reserved=lambda device: 0,
        graph_pool_handle=lambda: "pool",
        Stream=lambda device: SimpleNamespace(wait_stream=lambda other: None),
        current_stream=lambda: SimpleNamespace(wait_stream=lambda other: None),
        stream=lambda s: contextlib.nullcontext(),
        CUDAGraph=object,
        graph=graph,
        synchronize=lambda device: None,
    )
    monkeypatch.setattr(cuda_graph.torch, "cuda", fake)
    assert gc.isenabled()
    cuda_graph.capture_buckets(
        [1, 2], lambda b: seen.append((state["capturing"], gc.isenabled())), "cpu", "test"
    )
    assert {enabled for kind, enabled in seen if kind == "begin"} == {False}
    seen = [event for event in seen if event[0] != "begin"]
    assert {enabled for capturing, enabled in seen if capturing} == {False}
    assert {enabled for capturing, enabled in seen if not capturing} == {True}
    assert gc.isenabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_a_graph_collected_during_a_capture_does_not_break_it():
    """An unreachable graph (in a reference cycle, as an old worker's are) and a collector set
    to run at almost every allocation: the capture must not see a collection."""
    import gc

    from gpu_worker.graphs.capture import capture_buckets

    x = torch.zeros(64, device="cuda")
    old = capture_buckets([1], lambda b: x.add_(1), x.device, "old")
    cycle = {"graphs": old}
    cycle["self"] = cycle
    del old, cycle
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graphs = capture_buckets(
            [1, 2], lambda b: [torch.ones(8, device="cuda") * b for _ in range(50)], x.device, "new"
        )
    finally:
        gc.set_threshold(*threshold)
    graphs[2].replay()
    torch.cuda.synchronize()
