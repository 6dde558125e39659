"""bench_disturbance: the window statistics on made-up arrivals, and each scenario against a
server launched on a tiny random model (CPU)."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_disturbance as bench
from tests.e2e.server import Server
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.tokenizer_fixture import make_tiny_tokenizer


def test_a_gap_counts_in_the_window_its_later_event_arrives_in():
    a = [1.0, 1.002, 1.010, 2.5]
    b = [1.004, 1.006]
    stats = bench.window_stats([a, b], 1.0, 2.0)
    # a's 2 ms and 8 ms gaps, b's 2 ms one; a's 1,490 ms gap ends after the window
    assert stats["gaps"] == 3 and stats["gap_max_ms"] == pytest.approx(8.0)
    assert stats["gap_median_ms"] == pytest.approx(2.0)
    assert stats["events_per_s"] == pytest.approx(3.0)
    late = bench.window_stats([a, b], 2.0, 3.0)
    assert late["gaps"] == 1 and late["gap_max_ms"] == pytest.approx(1490.0)
    assert bench.window_stats([a], 5.0, 6.0)["gaps"] == 0


def test_a_stream_counts_the_events_that_carry_output():
    stream = bench.Stream(0.0)
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    stream.on_event(json.dumps(chunk).encode(), 1.0)
    stream.on_event(json.dumps(chunk).encode(), 1.5)
    chunk["choices"][0]["finish_reason"] = "length"
    stream.on_event(json.dumps(chunk).encode(), 2.0)
    stream.on_event(json.dumps({"choices": [], "usage": {}}).encode(), 2.1)
    stream.on_event(b"[DONE]", 2.2)
    assert stream.events == [1.0, 1.5] and stream.ttft == 1.0 and stream.finished


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_checkpoint(
        str(tmp_path_factory.mktemp("model")), "llama", vocab_size=384, max_position_embeddings=2048
    )
    make_tiny_tokenizer(model)
    with Server("--model-path", model, "--slow-client-timeout-s", "0.5") as running:
        yield running


@pytest.mark.parametrize("scenario", ["burst", "prefill", "slow"])
def test_each_disturbance_runs_beside_the_steady_streams(server, scenario, tmp_path):
    output = tmp_path / "out.json"
    argv = ["--base-url", server.url, "--scenario", scenario, "--steady", "3"]
    argv += ["--client-processes", "2"]
    argv += ["--output-len", "1500", "--settle-s", "0.3", "--window-s", "0.6"]
    argv += ["--burst", "4", "--burst-prompt-len", "8", "--burst-output-len", "4"]
    argv += ["--long", "2", "--long-prompt-len", "300", "--long-output-len", "2", "--slow", "2"]
    argv += ["--min-token-id", "3", "--max-token-id", "384", "--output", str(output)]
    bench.main(argv)
    result = json.loads(output.read_text())
    assert result["errors"] == [] and result["steady_finished_early"] == 0
    assert result["steady_without_output"] == 0
    for window in ("before", "during"):
        assert result[window]["gaps"] > 0 and result[window]["events_per_s"] > 0
    disturbance = result["disturbance"]
    assert disturbance["requests"] == {"burst": 4, "prefill": 2, "slow": 2}[scenario]
    if scenario != "slow":  # every disturbing request got its first token in the window
        assert disturbance["started"] == disturbance["requests"]
        assert 0 < disturbance["ttft_median_ms"] <= disturbance["ttft_max_ms"]
