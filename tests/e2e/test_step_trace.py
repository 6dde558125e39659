"""AERIE_STEP_TRACE in a launched server: the scheduler and the GPU worker each write their
events, and the summary walks complete chains of overlapped decode steps from them. The same
server runs AERIE_HOST_PROFILE over a few early plans: both processes write their profiles."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.e2e.server import Server
from tools.step_trace_summary import COLUMNS, load, step_chains, summarise

pytestmark = pytest.mark.e2e


def test_a_traced_server_writes_every_link_of_its_decode_steps(tiny_model_dirs, tmp_path):
    trace_dir = tmp_path / "trace"
    profile_dir = tmp_path / "profile"
    env = {
        "AERIE_STEP_TRACE": f"1,1000,{trace_dir}",  # past the run: written at shutdown
        "AERIE_HOST_PROFILE": f"2,4,{profile_dir}",  # written at plan 6
    }
    with Server("--model-path", tiny_model_dirs["llama"], env=env) as server:
        body = {"sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}

        def generate(i: int) -> int:
            reply = httpx.post(server.url + "/generate", json={"text": f"q{i}", **body}, timeout=60)
            return reply.json()["meta_info"]["completion_tokens"]

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert list(pool.map(generate, range(8))) == [24] * 8
        server.stop()
    assert sorted(p.name for p in trace_dir.iterdir()) == ["gpu_worker.json", "scheduler.json"]
    for process, function in (("gpu_worker", "(launch)"), ("scheduler", "(next_plan)")):
        assert (profile_dir / f"{process}.pstats").stat().st_size > 0
        assert function in (profile_dir / f"{process}.txt").read_text()
    events, plans = load(str(trace_dir))
    assert {mode for mode, _ in plans.values()} == {"extend", "decode"}
    rows = step_chains(events, plans, "decode")
    assert len(rows) >= 10
    for row in rows:  # the links follow each other in time
        assert all(row[name] >= 0 for name in COLUMNS if name in row), row
        assert row["chain"] >= row["apply"] + row["plan"] + row["launch"]
    # The overlap schedule (the default) plans step N+1 while N runs, once N-1's result is
    # applied, so the plan sent after N's result is N+2; it is N+1 exactly when one pass of
    # the scheduler's loop applied the results of both N-1 and N, leaving no chance to plan
    # N+1 in between (`with_previous`: the scheduler fell a step behind the worker, which
    # depends on timing). The other cause, a decode step waiting for KV that the plans in
    # flight hold, cannot happen here: thousands of tokens of KV, 8 requests of under 40.
    ahead = [row["next_plan_id"] - row["plan_id"] for row in rows]
    for row, n in zip(rows, ahead, strict=True):
        assert n == (1 if row["with_previous"] else 2), (row, ahead)
    # And the steps overlap. The pass after such a pair sends two plans, so no two consecutive
    # steps are both one ahead; and the decode steps come in long runs: some client sends two
    # requests, which take 23 decode steps each after their prefill, so there are at least 46
    # decode steps, at most 8 extend steps, and each of those costs at most 2 rows and splits
    # a run: at least 28 rows in at most 9 runs, of which at least (28 - 9) / 2 two ahead.
    behind = {row["plan_id"] for row in rows if row["with_previous"]}
    assert not behind & {n + 1 for n in behind}, ahead
    assert ahead.count(2) >= 10, ahead
    summary = summarise(rows)
    assert 1 <= summary["batch_size_median"] <= 4
