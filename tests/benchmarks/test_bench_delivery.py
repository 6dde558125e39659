"""bench_delivery runs on CPU: the tokenizer's app streams every token the feeder makes."""

import json

import pytest

from benchmarks import bench_delivery


@pytest.mark.parametrize("backend", ["native", "openai"])
def test_delivery_benchmark_streams_every_token(tmp_path, backend):
    out_path = tmp_path / "delivery.json"
    out = bench_delivery.main(
        [
            "--streams",
            "4",
            "--output-len",
            "12",
            "--rounds",
            "2",
            "--step-ms",
            "2",
            "--backend",
            backend,
            "--return-logprob",
            "--output",
            str(out_path),
        ]
    )
    assert (out["completed"], out["failed"], out["errors"]) == (8, 0, [])
    assert out["tokens_per_s"] * out["duration_s"] == pytest.approx(8 * 12)
    assert 1.0 <= out["tokens_per_event"] <= 12.0
    assert out["server_cpu_us_per_event"] > 0 and out["step_ms"]["median"] > 0
    assert json.loads(out_path.read_text())["events_per_s"] == out["events_per_s"]
