"""The step trace: what the recorder keeps and writes, and how the summary walks the chain from
one step's result to the launch of the next plan (tools/step_trace_summary.py)."""

from __future__ import annotations

import json

import pytest

from aerie.step_trace import StepTrace
from tools.step_trace_summary import device_idle, load, main, step_chains, summarise


def test_records_only_its_window_and_writes_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AERIE_STEP_TRACE", f"3,2,{tmp_path}/trace")
    trace = StepTrace.from_env("scheduler")
    for plan_id in (1, 2, 3, 4):
        trace.mark("applied", plan_id)
        trace.plan(plan_id, "decode", plan_id * 10)
    assert not (tmp_path / "trace" / "scheduler.json").exists()
    trace.mark("applied", 5)  # past the window: written now
    data = json.loads((tmp_path / "trace" / "scheduler.json").read_text())
    assert [(e, p) for e, p, _ in data["events"]] == [("applied", 3), ("applied", 4)]
    assert data["plans"] == {"3": ["decode", 30], "4": ["decode", 40]}
    trace.events.append(("applied", 4, 0))
    trace.write()  # once only: the file keeps the first write
    with open(trace.path) as f:
        assert len(json.load(f)["events"]) == 2


def test_from_env_is_off_without_the_variable_and_rejects_bad_values(monkeypatch):
    monkeypatch.delenv("AERIE_STEP_TRACE", raising=False)
    assert StepTrace.from_env("gpu_worker") is None
    for bad in ("10,5", "a,5,/tmp/x", "0,5,/tmp/x", "1,5,"):
        monkeypatch.setenv("AERIE_STEP_TRACE", bad)
        with pytest.raises(ValueError, match="AERIE_STEP_TRACE"):
            StepTrace.from_env("gpu_worker")


def overlapped_timeline(num_steps: int, gpu_us: int, host_us: dict[str, int]) -> dict:
    """Events of a served loop with two plans in flight, built the way the processes run: the
    device runs step k from max(its launch, the end of k-1) for gpu_us; the chain from
    ready(k) to launched(k+2) takes the given host times in order. Microseconds -> ns."""
    ev: dict[int, dict[str, int]] = {k: {} for k in range(1, num_steps + 1)}
    launched = {1: 0, 2: 10}
    ready: dict[int, int] = {}
    for k in range(1, num_steps + 1):
        ready[k] = max(launched[k], ready.get(k - 1, 0)) + gpu_us
        t = ready[k]
        ev[k].update(ready=t, launched=launched[k])
        for name, event in (
            ("pack", "result_out"),
            ("to_sched", "result_in"),
            ("apply", "applied"),
        ):
            t += host_us[name]
            ev[k][event] = t
        if k + 2 <= num_steps:
            t += host_us["plan"]
            ev[k + 2]["plan_out"] = t
            t += host_us["to_worker"]
            ev[k + 2]["plan_in"] = t
            t += host_us["launch"]
            launched[k + 2] = t
        ev[k]["done"] = ev[k]["applied"] + host_us["plan"] + 50
    ev[1]["plan_out"], ev[2]["plan_out"] = -20, -10
    ev[1]["plan_in"], ev[2]["plan_in"] = -5, 5
    return {k: {e: v * 1000 for e, v in d.items()} for k, d in ev.items()}


def test_the_chain_finds_each_link_and_the_devices_wait():
    # 800 us from one step's result to the launch of the step two later
    host = dict(pack=20, to_sched=60, apply=300, plan=200, to_worker=60, launch=160)
    events = overlapped_timeline(12, 1000, host)
    plans = {k: ("decode", 64) for k in events}
    rows = step_chains(events, plans, "decode")
    assert len(rows) == 10  # the last two steps have no later plan
    for row in rows:
        for name, us in host.items():
            assert row[name] == pytest.approx(us)
        assert row["chain"] == pytest.approx(800)
        assert row["busy"] == pytest.approx(300 + 200 + 50)  # result_in -> done
    # The host's 800 us fit inside one 1000 us step: the device never waits once running.
    assert summarise(rows[2:])["idle_estimate"] == pytest.approx(0.0)

    # Now the chain C = 1600 us outlasts the step G = 1000 us queued behind it. With two
    # plans in flight the chains of odd and even steps run side by side, so the steps
    # alternate: one waits C - G for its launch, the next follows at once. On average a step
    # takes P = (C + G) / 2 and waits P - G.
    slow = dict(host, apply=1100)
    rows = step_chains(overlapped_timeline(16, 1000, slow), plans, "decode")[6:]
    assert len(rows) % 2 == 0
    assert sorted({row["wait"] for row in rows}) == pytest.approx([0, 600])
    summary = summarise(rows)
    assert summary["period"]["mean"] == pytest.approx(1300)
    assert summary["wait"]["mean"] == pytest.approx(300)
    assert summary["idle_estimate"] == pytest.approx(300 / 1300)


def test_mode_filter_and_the_files_merge(tmp_path):
    events = overlapped_timeline(
        8, 1000, {"pack": 1, "to_sched": 1, "apply": 1, "plan": 1, "to_worker": 1, "launch": 1}
    )
    plans = {k: ("decode" if k != 5 else "extend", 8) for k in events}
    kept = {row["plan_id"] for row in step_chains(events, plans, "decode")}
    assert kept == {1, 2, 6}  # the chains of 3, 4 and 5 touch plan 5
    assert len(step_chains(events, plans, None)) == 6
    worker = {"ready", "launched", "result_out", "plan_in"}
    for process, names in (("gpu_worker", worker), ("scheduler", None)):
        rows = [
            [e, k, t]
            for k, d in events.items()
            for e, t in d.items()
            if (e in worker) == (names is not None)
        ]
        sent = {} if names else {str(k): list(v) for k, v in plans.items()}
        (tmp_path / f"{process}.json").write_text(json.dumps({"events": rows, "plans": sent}))
    assert load(str(tmp_path)) == (events, plans)
    assert main([str(tmp_path), "--mode", "all"])["steps"] == 6
    assert main([str(tmp_path), "--mode", "all", "--batch-size", "9-64"])["steps"] == 0
    assert main([str(tmp_path), "--mode", "all", "--batch-size", "8"])["steps"] == 6


def test_device_idle_from_the_cuda_event_values(tmp_path):
    trace = StepTrace("gpu_worker", 1, 10, str(tmp_path))
    for plan_id, gap, span in ((1, 0.0, 1000.0), (2, 500.0, 1000.0), (3, 50.0, 2000.0)):
        trace.value("gpu_gap_us", plan_id, gap)
        trace.value("gpu_span_us", plan_id, span)
    trace.value("gpu_gap_us", 11, 1e6)  # outside the window
    trace.write()
    (tmp_path / "scheduler.json").write_text(
        json.dumps(
            {"events": [], "plans": {"1": ["decode", 4], "2": ["decode", 64], "3": ["extend", 4]}}
        )
    )
    events, plans = load(str(tmp_path))
    assert 11 not in events
    every = device_idle(events, plans, None, (1, 64))
    assert every["steps"] == 3 and every["idle_between_steps"] == pytest.approx(550 / 4550)
    decode = device_idle(events, plans, "decode", (1, 64))
    assert decode["idle_between_steps"] == pytest.approx(500 / 2500)
    assert device_idle(events, plans, "decode", (1, 8))["idle_between_steps"] == 0.0
    assert device_idle(events, plans, "decode", (100, 200)) is None


def test_with_previous_marks_a_result_that_came_in_before_the_pass_of_the_one_before_ended():
    """The scheduler applies every waiting result in one pass: a step whose result came in
    before the pass that applied the previous one ended (result_in(N) < done(N-1)) shares that
    pass, so the plan after it can only be N+1 (the e2e test checks the served rule)."""
    host = dict(pack=20, to_sched=60, apply=300, plan=200, to_worker=60, launch=160)
    events = overlapped_timeline(12, 1000, host)
    plans = {k: ("decode", 64) for k in events}
    rows = {row["plan_id"]: row for row in step_chains(events, plans, "decode")}
    assert "with_previous" not in rows[1]  # no step before it was traced
    assert not any(row["with_previous"] for n, row in rows.items() if n > 1)
    events[6]["result_in"] = events[5]["done"] - 1
    rows = {row["plan_id"]: row for row in step_chains(events, plans, "decode")}
    assert [n for n, row in rows.items() if row.get("with_previous")] == [6]
