"""benchmarks/plot_streams.py: the points each line draws."""

from __future__ import annotations

from benchmarks.plot_streams import series


def test_series_sorts_each_runs_points_by_concurrency():
    runs = {
        "256": {"output_throughput": 80.0, "itl_ms": {"median": 2.5, "p99": 7.0}},
        "1": {"output_throughput": 1.7, "itl_ms": {"median": 0.6, "p99": 0.9}},
        "64": {"output_throughput": 46.0, "itl_ms": {"median": 1.3, "p99": 2.4}},
    }
    assert series(runs, "output_throughput") == ([1, 64, 256], [1.7, 46.0, 80.0])
    assert series(runs, "itl_ms", "p99") == ([1, 64, 256], [0.9, 2.4, 7.0])
