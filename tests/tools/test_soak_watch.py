"""The soak client's stuck-request watch (`tools/soak_watch.py`): which requests count as
stuck, and a soak against a server that never answers one request stops and reports it (and
where the server holds it) instead of waiting for it."""

from __future__ import annotations

import asyncio

import pytest

from aerie.codec import pack_ids
from aerie.messages import SamplingParams, TokenizedRequest
from aerie.outputs import OutputsWriter
from tests.tokenizer_proc.harness import FakeEngine, LiveServer, fake_output_ids, make_frontend
from tools import soak_watch
from tools.soak import Soak
from tools.soak_plan import MAX_NEW, Planned
from tools.soak_watch import StuckWatch, client_rid, stuck_problems


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def planned(index: int, kind: str = "http") -> Planned:
    return Planned(index, kind, prompt=0, max_new=4)


def test_a_request_is_stuck_only_once_many_others_finished_without_it():
    clock = Clock()
    watch = StuckWatch(concurrency=2, clock=clock)
    overtaken = 2 * soak_watch.STUCK_OVERTAKEN
    watch.start(planned(0), "soak-0")
    for index in range(1, overtaken):  # a slow machine: few finish, however long it takes
        watch.start(planned(index), client_rid(planned(index)))
        clock.now += 100.0
        watch.finish(index)
    assert watch.stuck() == ("", [])
    watch.start(planned(overtaken), None)
    watch.finish(overtaken)
    why, stuck = watch.stuck()
    assert [flight.req.index for flight in stuck] == [0] and f"{overtaken} or more" in why
    assert watch.max_overtaken == 0  # counted when a waiting request hears back


def test_a_reply_restarts_the_count_and_a_fast_machine_waits_the_minimum():
    clock = Clock()
    watch = StuckWatch(concurrency=1, clock=clock)
    watch.start(planned(0, "zmq_stream"), "soak-0")
    for index in range(1, 10):
        watch.start(planned(index), None)
        watch.finish(index)
    assert watch.stuck() == ("", [])  # many finished, but within STUCK_MIN_S
    clock.now += soak_watch.STUCK_MIN_S
    watch.reply(0, [5, 6])
    assert watch.stuck() == ("", []) and watch.max_overtaken == 9
    assert watch.flights[0].output_ids == [5, 6] and watch.flights[0].num_replies == 1


def test_no_request_finishing_at_all_reports_every_request_in_flight():
    clock = Clock()
    watch = StuckWatch(concurrency=16, clock=clock)
    watch.start(planned(0), "soak-0")
    clock.now += 1.0
    watch.start(planned(1), "soak-1")
    clock.now = soak_watch.ENGINE_STALL_S - 0.5  # since the watch started
    assert watch.stuck() == ("", [])
    clock.now += 0.5
    why, stuck = watch.stuck()
    assert "no request finished" in why and [f.req.index for f in stuck] == [0, 1]


class HoldOne(FakeEngine):
    """Answers every request but the one sent with client rid `held`: that one gets its first
    step's outputs and never finishes."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.delay_s = 0.001

    async def play(self, request: TokenizedRequest) -> None:
        tracker = self.frontend.tracker
        if next(e["id"] for e in tracker.describe() if e["rid"] == request.rid) != self.held:
            await super().play(request)
            return
        writer = OutputsWriter()
        writer.add(request.frontend, request.rid, pack_ids(fake_output_ids(request)[:2]))
        for message in writer.take():
            tracker.feed(message)


@pytest.mark.parametrize("kind", ["http", "zmq_stream"])
def test_a_soak_stops_on_a_request_the_server_never_finishes_and_says_where_it_is(
    tokenizer_dir, monkeypatch, kind
):
    monkeypatch.setattr(soak_watch, "STUCK_MIN_S", 0.5)
    monkeypatch.setattr(soak_watch, "WATCH_INTERVAL_S", 0.05)
    frontend, _ = make_frontend(tokenizer_dir)
    engine = HoldOne(held="soak-5")
    frontend.backend, engine.frontend = engine, frontend
    frontend.mark_ready({"page_size": 1, "max_total_tokens": 1000, "enable_debug_info": True})
    prompts = [[11, 12, 13]]
    requests = [Planned(i, "zmq" if i % 2 else "http", 0, MAX_NEW) for i in range(400)]
    requests[5] = Planned(5, kind, 0, MAX_NEW)
    with LiveServer(frontend) as server:
        runner = Soak(server.url, server.zmq_address, prompts, lambda ids: "", concurrency=4)
        greedy = TokenizedRequest("r", pack_ids(prompts[0]), SamplingParams(MAX_NEW))
        reference = fake_output_ids(greedy)
        runner.references, runner.reference_texts = [reference], [""]
        outcomes = asyncio.run(asyncio.wait_for(runner.run(requests, lambda _: None), 60))

    overtaken = 4 * soak_watch.STUCK_OVERTAKEN
    assert overtaken <= len(outcomes) < 400 and 5 not in [o.index for o in outcomes]
    assert all(o.status == "ok" for o in outcomes), outcomes
    (stuck,) = runner.stuck["requests"]
    assert (stuck["index"], stuck["kind"], stuck["rid"]) == (5, kind, "soak-5")
    assert stuck["prompt_ids"] == prompts[0] and stuck["finished_meanwhile"] >= overtaken
    if kind == "zmq_stream":  # the first outputs arrived, and are reported
        assert stuck["replies"] == 1 and stuck["output_ids"] == reference[:2]
    assert stuck["server"].startswith("tokenizer: in flight")
    assert "scheduler 0: rid " in stuck["server"]  # the engine's describe() holds it
    assert runner.stuck["server"]["num_in_flight"] >= 1
    problems = stuck_problems(runner.stuck)
    assert problems[0].startswith(f"stopped: no reply while {overtaken} or more others finished")
    assert problems[1].startswith(f"stuck: request 5 ({kind}, rid soak-5)")
