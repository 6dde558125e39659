"""GET /debug/requests (--enable-debug-info only): where each unfinished request is, in the
tokenizer's tracker and in each scheduler, which the real process asks with a DebugQuery."""

from __future__ import annotations

import asyncio

import httpx

from aerie.messages import DebugQuery, DebugReport
from tests.tokenizer_proc.harness import wait_until
from tokenizer_proc import process as tokenizer_process
from tokenizer_proc.process import SchedulerBackend


def test_the_view_is_refused_without_enable_debug_info(live):
    server, _, _ = live
    r = httpx.get(server.url + "/debug/requests")
    assert r.status_code == 404
    assert "--enable-debug-info" in r.json()["error"]["message"]


def test_the_view_lists_each_request_in_flight_where_it_is(live):
    server, frontend, engine = live
    frontend.mark_ready({"page_size": 1, "max_total_tokens": 1000, "enable_debug_info": True})
    engine.hold = True  # one delta, then never finished
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}, "rid": "mine"}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/generate", json={**body, "stream": True}):
            assert wait_until(lambda: frontend.tracker.num_in_flight == 1)
            view = client.get(server.url + "/debug/requests").json()
    (entry,) = view["tokenizer"]
    assert entry["id"] == "mine" and entry["rid"] == engine.submitted[0].rid
    assert entry["output_tokens"] == 2 and entry["age_s"] >= 0
    assert view["schedulers"] == [
        {"replica": 0, "answered": True, "requests": [{"rid": entry["rid"]}]}
    ]


HELD = [{"rid": "r1", "state": "waiting", "queue_position": 0}]


class FakeScheduler:
    """A scheduler's inbox that answers a DebugQuery at once (`answer`), or never."""

    def __init__(self, replica: int, answer: bool) -> None:
        self.replica, self.answer = replica, answer
        self.backend: SchedulerBackend | None = None

    async def send(self, message: DebugQuery) -> None:
        if self.answer:
            report = DebugReport(message.query_id, self.replica, {"plans_in_flight": 1}, HELD)
            asyncio.get_running_loop().call_soon(self.backend.on_debug_report, report)


def test_the_backend_asks_every_scheduler_and_names_one_that_does_not_answer(monkeypatch):
    monkeypatch.setattr(tokenizer_process, "DEBUG_QUERY_TIMEOUT_S", 0.2)
    schedulers = [FakeScheduler(0, answer=True), FakeScheduler(1, answer=False)]
    backend = SchedulerBackend(schedulers)
    for scheduler in schedulers:
        scheduler.backend = backend
    assert asyncio.run(backend.describe()) == [
        {"replica": 0, "answered": True, "plans_in_flight": 1, "requests": HELD},
        {"replica": 1, "answered": False},
    ]
    backend.on_debug_report(DebugReport(0, 1, {}, []))  # an answer after the timeout: dropped
