"""The ZMQ frontend's per-connection error reply budget and its rate-limited frame log."""

from __future__ import annotations

import logging

from tokenizer_proc.zmq_limits import ErrorReplyBudget, FrameLog


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_error_replies_come_in_a_burst_then_at_the_refill_rate():
    clock = Clock()
    budget = ErrorReplyBudget(burst=4, per_s=2.0, clock=clock)
    assert [budget.take(b"a") for _ in range(5)] == [True] * 4 + [False]
    clock.now += 0.5  # one reply's worth
    assert [budget.take(b"a") for _ in range(2)] == [True, False]
    clock.now += 60.0  # refills up to the burst, no further
    assert [budget.take(b"a") for _ in range(5)] == [True] * 4 + [False]


def test_each_connection_has_its_own_budget_and_tracking_is_bounded():
    clock = Clock()
    budget = ErrorReplyBudget(burst=2, per_s=1.0, max_tracked=3, clock=clock)
    assert [budget.take(b"flood") for _ in range(3)] == [True, True, False]
    assert budget.take(b"other")  # untouched by the flood
    budget.take(b"c")
    budget.take(b"flood")  # refused, but now the most recently seen
    budget.take(b"d")
    assert len(budget) == 3  # "other" was seen least recently and is forgotten
    assert not budget.take(b"flood")
    budget.forget(b"flood")  # its connection went away
    assert budget.take(b"flood")


def test_a_flood_of_warnings_logs_one_line_per_interval(caplog):
    clock = Clock()
    frame_log = FrameLog(logging.getLogger("zmq-limits-test"), interval_s=5.0, clock=clock)
    with caplog.at_level(logging.WARNING, logger="zmq-limits-test"):
        frame_log.warn("malformed frames", "refused a ZMQ client frame: first")
        for i in range(30_000):  # 10,000 a second for 3 s, a tenth of them answered
            clock.now += 1e-4
            frame_log.warn("unauthenticated frames", "refused", answered=i % 10 == 0)
        frame_log.flush_due()  # the interval has not ended: nothing yet
        assert [r.getMessage() for r in caplog.records] == ["refused a ZMQ client frame: first"]
        clock.now += 2.0
        frame_log.flush_due()
        frame_log.flush_due()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2
    assert "30000 unauthenticated frames" in messages[1] and "27000 frames dropped" in messages[1]
    clock.now += 60.0
    frame_log.warn("malformed frames", "after a quiet spell", answered=False)
    assert caplog.records[-1].getMessage() == "after a quiet spell (not answered)"
