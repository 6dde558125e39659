"""bench_prefill on CPU at a tiny size: every (cached, new) pair is timed and profiled."""

from __future__ import annotations

import json

from benchmarks import bench_prefill as bench
from tests.gpu_worker.checkpoints import make_tiny_checkpoint


def test_each_pair_is_timed_and_profiled(tmp_path):
    model = make_tiny_checkpoint(str(tmp_path / "model"), "llama", vocab_size=384)
    output = tmp_path / "prefill.json"
    argv = ["--models", model, "--new", "1,24", "--cached", "0,40", "--device", "cpu"]
    argv += ["--repeats", "2", "--warmup", "1", "--profile-top", "3", "--output", str(output)]
    bench.main(argv)
    rows = json.loads(output.read_text())
    assert [(r["cached"], r["new"]) for r in rows] == [(0, 1), (0, 24), (40, 1), (40, 24)]
    for row in rows:
        assert 0 < row["launch_ms"] <= row["total_ms"]
        ops = [name for name, _ in row["profile"]["top_cpu_ms"]]
        assert len(ops) == 3 and any(name.startswith("aten::") for name in ops)
