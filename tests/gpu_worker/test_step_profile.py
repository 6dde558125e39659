"""The profiled window of served steps (`StepProfiler`) and the CUPTI record reader, on CPU:
the window's bounds, its summary, the tracer choice, and the record offsets against the
documented CUPTI record layouts. The tracer itself runs in tests/gpu_worker/test_cuda.py."""

from __future__ import annotations

import ctypes
import json
from collections import Counter

import pytest

from gpu_worker.tooling import cupti_trace, step_profile
from gpu_worker.tooling.cupti_trace import (
    CONCURRENT_KERNEL,
    GRAPH_TRACE,
    MEMCPY,
    MEMSET,
    read_records,
)


# The leading fields of CUPTI's records (cupti_activity.h), up to their end timestamps.
class GraphRecord(ctypes.Structure):  # CUpti_ActivityGraphTrace2
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("correlation_id", ctypes.c_uint32),
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
    ]


class KernelRecord(ctypes.Structure):  # CUpti_ActivityKernel4 .. 11
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("cache_config", ctypes.c_uint8),
        ("shared_memory_config", ctypes.c_uint8),
        ("registers", ctypes.c_uint16),
        ("cache_requested", ctypes.c_uint32),
        ("cache_executed", ctypes.c_uint32),
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
    ]


class MemcpyRecord(ctypes.Structure):  # CUpti_ActivityMemcpy5 / 6
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("copy_kind", ctypes.c_uint8),
        ("src_kind", ctypes.c_uint8),
        ("dst_kind", ctypes.c_uint8),
        ("flags", ctypes.c_uint8),
        ("bytes", ctypes.c_uint64),
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
    ]


class MemsetRecord(ctypes.Structure):  # CUpti_ActivityMemset4
    _fields_ = [
        ("kind", ctypes.c_uint32),
        ("value", ctypes.c_uint32),
        ("bytes", ctypes.c_uint64),
        ("start", ctypes.c_uint64),
        ("end", ctypes.c_uint64),
    ]


def walk(records: list[ctypes.Structure]):
    """A next_record over these records, as cuptiActivityGetNextRecord walks a buffer."""
    addresses = iter([ctypes.addressof(r) for r in records])

    def next_record(pointer: ctypes.c_void_p) -> bool:
        address = next(addresses, None)
        if address is None:
            return False
        pointer.value = address
        return True

    return next_record


def test_records_give_their_intervals_in_microseconds_by_kind_from_the_window_on():
    records = [
        GraphRecord(GRAPH_TRACE, 7, 1_000_000, 1_500_000),
        KernelRecord(CONCURRENT_KERNEL, 1, 2, 3, 4, 5, 2_000_000, 2_010_000),
        MemcpyRecord(MEMCPY, 1, 2, 3, 0, 4096, 900_000, 901_000),
        MemsetRecord(MEMSET, 0, 64, 3_000_000, 3_000_500),
        GraphRecord(5, 0, 1, 2),  # another kind (an API record): skipped
        GraphRecord(GRAPH_TRACE, 8, 0, 0),
    ]
    counts, intervals = Counter(), []
    read_records(walk(records), counts, intervals)
    assert intervals == [(1000.0, 1500.0), (2000.0, 2010.0), (900.0, 901.0), (3000.0, 3000.5)]
    assert counts == {"graph": 1, "kernel": 1, "memcpy": 1, "memset": 1, "untimed": 1}
    counts, intervals = Counter(), []
    read_records(walk(records), counts, intervals, since=1_000_000)  # the memcpy started before
    assert intervals == [(1000.0, 1500.0), (2000.0, 2010.0), (3000.0, 3000.5)]
    assert counts == {"graph": 1, "kernel": 1, "memset": 1, "untimed": 1}


class FakeTrace:
    calls: list[str] = []

    def start(self) -> None:
        FakeTrace.calls.append("start")

    def window(self) -> None:
        FakeTrace.calls.append("window")

    def stop(self):
        FakeTrace.calls.append("stop")
        return [(0.0, 40.0), (50.0, 100.0)], {"graph": 2}


def test_the_window_traces_steps_first_to_first_plus_count(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(step_profile, "GraphTrace", FakeTrace)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setenv(step_profile.ENV, f"2,3,{tmp_path / 'idle.json'}")
    FakeTrace.calls = []
    profiler = step_profile.StepProfiler.from_env()
    assert FakeTrace.calls == ["start"]  # recording before any graph is captured
    for step in range(7):  # two steps in flight: step N+1 launches before step N finishes
        profiler.on_launch("extend" if step == 3 else "decode", 10 * step)
        if step:
            profiler.on_finish()  # step - 1
        want = ["start"] + (["window"] if step >= 2 else []) + (["stop"] if step >= 5 else [])
        assert FakeTrace.calls == want, step
    summary = json.loads((tmp_path / "idle.json").read_text())
    assert summary["steps"] == 3 and summary["tracer"] == "graphs"
    assert summary["records"] == {"graph": 2}
    assert summary["modes"] == {"decode": 2, "extend": 1} and summary["mean_batch_size"] == 30
    assert summary["gpu_busy_us"] == 90.0 and summary["span_us"] == 100.0
    assert summary["idle_share"] == pytest.approx(0.1)
    assert summary["long_gaps"] == 1 and summary["host_wait_share"] == pytest.approx(0.1)


def test_the_tracer_is_chosen_by_name_and_a_bad_one_is_refused(monkeypatch):
    monkeypatch.setattr(step_profile, "GraphTrace", FakeTrace)
    monkeypatch.delenv(step_profile.TRACER_ENV, raising=False)
    monkeypatch.setenv(step_profile.ENV, "1,2,/tmp/x.json")
    assert step_profile.StepProfiler.from_env().tracer == "graphs"
    monkeypatch.setenv(step_profile.TRACER_ENV, "kernels")
    assert step_profile.StepProfiler.from_env().tracer == "kernels"
    monkeypatch.setenv(step_profile.TRACER_ENV, "nodes")
    with pytest.raises(ValueError, match="AERIE_PROFILE_TRACER must be one of graphs, kernels"):
        step_profile.StepProfiler.from_env()
    monkeypatch.setenv(step_profile.ENV, "1,x,/tmp/x.json")
    with pytest.raises(ValueError, match="FIRST,COUNT,PATH"):
        step_profile.StepProfiler.from_env()
    monkeypatch.delenv(step_profile.TRACER_ENV)
    monkeypatch.setenv(step_profile.ENV, "1,0,/tmp/x.json")
    with pytest.raises(ValueError, match="COUNT >= 1"):
        step_profile.StepProfiler.from_env()


def test_a_failed_window_is_logged_and_serving_goes_on(monkeypatch, tmp_path, caplog):
    import torch

    class FailingTrace(FakeTrace):
        def stop(self):
            raise RuntimeError("CUPTI flushing records failed")

    monkeypatch.setattr(step_profile, "GraphTrace", FailingTrace)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    profiler = step_profile.StepProfiler(0, 1, str(tmp_path / "idle.json"))
    profiler.on_launch()
    profiler.on_finish()
    assert "window of steps 0..0 was lost" in caplog.text and profiler.trace is None
    assert not (tmp_path / "idle.json").exists()
    profiler.on_launch()
    profiler.on_finish()  # later steps: nothing left to do


def test_libcupti_is_the_loaded_one_else_found_else_the_error_says_what_to_do(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 0:0 0 /usr/lib/libc.so.6\n")
    with pytest.raises(RuntimeError, match="AERIE_PROFILE_TRACER=kernels"):
        cupti_trace.find_libcupti(str(maps), [str(tmp_path)])
    wheel = tmp_path / "nvidia" / "cu13" / "lib"
    wheel.mkdir(parents=True)
    (wheel / "libcupti.so.13").touch()
    assert cupti_trace.find_libcupti(str(maps), [str(tmp_path)]) == str(wheel / "libcupti.so.13")
    maps.write_text("7f00-7f01 r-xp 0 0:0 0 /opt/cuda/lib/libcupti.so.12\n")
    assert cupti_trace.find_libcupti(str(maps), [str(tmp_path)]) == "/opt/cuda/lib/libcupti.so.12"
