"""The soak test at CI size, as the overlap schedule's stress test: over a thousand requests of
every kind (HTTP and ZMQ, streaming and not, OpenAI, stop strings, sampled, client
disconnects, timeouts, aborts) with random prompt and output lengths against a launched server
whose KV cache forces retraction, with and without speculation, with the overlap schedule and
without, the prefix cache on. Every completed greedy request must equal its single-request
output (taken with nothing cached), and once idle /server_info must show nothing running,
waiting or holding KV, and /flush_cache every page free exactly once. `python tools/soak.py`
runs the full 10,000.

A stuck request stops the soak with a report of it and of where the server holds it (the
report's problems), and so does a soak that would outlast pytest's timeout on a slow machine;
progress lines are printed, so a failure's captured output shows how far it got."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.server import Server
from tests.gpu_worker.draft_checkpoints import make_tiny_eagle_draft
from tools.soak import soak
from tools.soak_plan import GREEDY_KINDS, KIND_WEIGHTS
from tools.soak_server import server_pids, soak_server_args

pytestmark = pytest.mark.e2e

CONCURRENCY = 16
# Past this, from the test's start, the soak stops and reports what is in flight: inside the
# 600 s pytest timeout, with time left to ask the server where they are and to stop it.
SOAK_BUDGET_S = 480.0


@pytest.mark.parametrize(
    "speculative, overlap, requests",
    [(False, True, 1200), (True, True, 1200), (False, False, 500), (True, False, 500)],
    ids=["plain-overlap", "eagle-overlap", "plain-serial", "eagle-serial"],
)
def test_soak_every_kind_completes_exactly_and_leaves_nothing_behind(
    tiny_model_dirs, tmp_path, speculative, overlap, requests
):
    started = time.monotonic()
    model = tiny_model_dirs["llama"]
    draft = make_tiny_eagle_draft(str(tmp_path / "draft"), model) if speculative else None
    args = soak_server_args(model, CONCURRENCY, draft, overlap)
    with Server(*args, "--tokenizer-worker-num", "2") as server:  # behind two frontends
        pids = server_pids(server)
        assert set(pids) == {"launcher", "tokenizer", "tokenizer1", "scheduler", "gpu_worker"}
        time_limit_s = SOAK_BUDGET_S - (time.monotonic() - started)
        report = soak(
            server.url,
            server.zmq_address,
            pids,
            model,
            vocab=320,
            requests=requests,
            concurrency=CONCURRENCY,
            seed=1,
            warmup_fraction=0.25,
            max_rss_growth=0.10,
            log=print,
            time_limit_s=time_limit_s,
        )
        where = httpx.get(server.url + "/debug/requests", timeout=30).json()

    assert report.problems == [], "\n".join(report.problems)
    # Idle, the debug view finds nothing in flight in the tokenizer or the scheduler.
    assert where["tokenizer"] == []
    assert [(s["answered"], s["requests"]) for s in where["schedulers"]] == [(True, [])]
    assert report.idle["disable_overlap_schedule"] is not overlap
    assert (report.idle["speculative_algorithm"] == "EAGLE") is speculative
    assert set(report.kinds) == set(KIND_WEIGHTS)
    assert report.statuses.get("failed", 0) == 0
    # The checks had something to check: exact greedy outputs of every greedy kind, stop strings
    # that cut a stream, aborted requests, and retraction under the small KV cache.
    assert report.greedy_checked >= requests * sum(KIND_WEIGHTS[k] for k in GREEDY_KINDS) // (
        2 * sum(KIND_WEIGHTS.values())
    )
    assert report.stopped_by_string > 0
    assert report.statuses.get("aborted", 0) > 0
    assert report.num_retractions > 0
    assert report.cached_prompt_tokens > requests  # the prefix cache served many prompts
    assert (report.idle["num_running"], report.idle["num_waiting"]) == (0, 0)
    assert report.idle["kv_used_tokens"] == 0
    assert set(report.rss_growth) == set(pids)
