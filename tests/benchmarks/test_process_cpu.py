"""Where a run's CPU goes: Aerie processes found by their names, their CPU share over a run."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks import bench_serving
from benchmarks.process_cpu import CpuMeter, aerie_processes, cpu_seconds

# Names itself as an engine process does, burns CPU for a while, then idles until killed.
CHILD = """
import time
from aerie.process import die_with_parent
die_with_parent("scheduler")
print("named", flush=True)
end = time.perf_counter() + 0.6
while time.perf_counter() < end:
    pass
time.sleep(60)
"""


def test_cpu_seconds_count_this_process_burning_cpu():
    before = cpu_seconds(__import__("os").getpid())
    end = time.perf_counter() + 0.3
    while time.perf_counter() < end:
        pass
    after = cpu_seconds(__import__("os").getpid())
    assert before is not None and after is not None and 0.15 < after - before < 1.0
    assert cpu_seconds(2**22 + 12345) is None  # no such process


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_an_engine_process_is_found_by_name_and_its_share_measured():
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "named"
        found = aerie_processes()
        names = [name for name, pid in found.items() if pid == child.pid]
        assert names and names[0].split("#")[0] == "scheduler"
        meter = CpuMeter()
        time.sleep(0.4)  # inside the child's busy window
        share = meter.shares()[names[0]]
        assert 0.3 < share <= 1.2  # about one core
    finally:
        child.kill()
        child.wait()


def test_the_summary_reports_and_prints_the_shares(capsys):
    summary = bench_serving.summarize([], 1.0, None, {"scheduler": 0.97, "client": 0.25})
    assert summary["cpu_share"] == {"scheduler": 0.97, "client": 0.25}
    bench_serving.print_summary(summary)
    assert "CPU share (cores)" in capsys.readouterr().out
    assert bench_serving.summarize([], 1.0, None)["cpu_share"] == {}
