"""bench_scheduler_step runs on CPU: every request decodes through the measured steps."""

from benchmarks import bench_scheduler_step


def test_scheduler_step_benchmark_runs_every_request(tmp_path):
    out = tmp_path / "rows.json"
    rows = bench_scheduler_step.main(
        ["--batch-size", "1,5", "--steps", "4", "--page-size", "4", "--output", str(out)]
    )
    assert [r["batch_size"] for r in rows] == [1, 5]
    for r in rows:
        assert r["step_us"] > 0
        assert abs(r["per_request_us"] * r["batch_size"] - r["step_us"]) < 1e-6
    assert out.exists()
