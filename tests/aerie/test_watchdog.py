"""The launcher's watchdog verdicts, on a fake clock: a busy child that answers and moves is
alive; a silent one, or one busy without progress past its bound, is stuck."""

from __future__ import annotations

from aerie.messages import HeartbeatAck
from aerie.watchdog import Watchdog

STEP = "step 17 (extend, 7,000 tokens, 1 request) on the host"


def _watchdog(monkeypatch, **kwargs) -> Watchdog:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    options = {"timeout_s": 30.0, "busy_timeout_s": 600.0, "long_work": ("gpu_worker",)}
    return Watchdog(("scheduler", "gpu_worker"), **{**options, **kwargs}, now=0.0)


def _answer_every_second(watchdog: Watchdog, until: float, **acks: tuple[str, int]) -> None:
    """Each named child answers once a second up to `until`, with (doing, progress) and the
    busy time since t=0."""
    for t in range(1, int(until) + 1):
        for name, (doing, progress) in acks.items():
            busy_s = float(t) if doing else 0.0
            watchdog.answered(HeartbeatAck(name, t, doing, busy_s, progress), float(t))


def test_a_worker_busy_on_one_long_step_is_alive_until_the_busy_bound(monkeypatch):
    watchdog = _watchdog(monkeypatch)
    # The old rule killed this at 30 s: the step answers from its thread, but never moves.
    _answer_every_second(watchdog, 599, scheduler=("", 5), gpu_worker=(STEP, 9))
    assert watchdog.stuck(599.0) is None
    _answer_every_second(watchdog, 602, scheduler=("", 5), gpu_worker=(STEP, 9))
    name, why = watchdog.stuck(602.0)
    assert name == "gpu_worker"
    assert "no progress for 601 s (--watchdog-busy-timeout-s 600)" in why
    assert STEP in why and "busy for 602 s" in why


def test_a_busy_child_whose_progress_moves_is_never_stuck(monkeypatch):
    watchdog = _watchdog(monkeypatch, busy_timeout_s=60.0)
    for t in range(1, 1000):
        ack = HeartbeatAck("gpu_worker", t, STEP, float(t), progress=t // 20)  # moves every 20 s
        watchdog.answered(ack, float(t))
        watchdog.answered(HeartbeatAck("scheduler", t), float(t))
        assert watchdog.stuck(float(t)) is None, t


def test_an_idle_child_that_answers_is_alive_however_long(monkeypatch):
    watchdog = _watchdog(monkeypatch, busy_timeout_s=60.0)
    _answer_every_second(watchdog, 1000, scheduler=("", 3), gpu_worker=("", 8))
    assert watchdog.stuck(1000.0) is None


def test_a_silent_child_is_stuck_and_named_with_what_it_was_doing(monkeypatch):
    watchdog = _watchdog(monkeypatch)
    _answer_every_second(watchdog, 10, scheduler=("", 5), gpu_worker=(STEP, 9))
    _answer_every_second(watchdog, 45, scheduler=("", 5))  # the worker stops answering at 10
    assert watchdog.stuck(40.0) is None
    name, why = watchdog.stuck(41.0)
    assert name == "gpu_worker"
    assert why.startswith("has not answered a heartbeat for 31 s (--watchdog-timeout-s 30)")
    assert f"at its last answer: on {STEP}, busy for 10 s" in why


def test_a_child_that_never_answers_is_stuck_after_the_timeout(monkeypatch):
    watchdog = _watchdog(monkeypatch)
    _answer_every_second(watchdog, 40, gpu_worker=("", 1))
    assert watchdog.stuck(30.0) is None
    name, why = watchdog.stuck(31.0)
    assert name == "scheduler" and "has not answered a heartbeat" in why and "idle" in why


def test_a_process_other_than_a_worker_is_bounded_by_the_heartbeat_timeout(monkeypatch):
    """A scheduling pass is short: busy without progress for --watchdog-timeout-s is stuck."""
    watchdog = _watchdog(monkeypatch)
    _answer_every_second(watchdog, 31, scheduler=("a scheduling pass", 4), gpu_worker=("", 1))
    assert watchdog.stuck(31.0) is None  # its progress last moved at its first answer, at 1
    name, why = watchdog.stuck(32.0)
    assert name == "scheduler"
    assert "no progress for 31 s (--watchdog-timeout-s 30) on a scheduling pass" in why


def test_long_units_of_work_are_logged_once_past_the_timeout_then_rate_limited(monkeypatch):
    watchdog = _watchdog(monkeypatch, timeout_s=2.0)
    lines = []
    for t in range(1, 26):
        watchdog.answered(HeartbeatAck("gpu_worker", t, STEP, float(t), 1), float(t))
        watchdog.answered(HeartbeatAck("scheduler", t), float(t))
        lines += [(t, line) for line in watchdog.reports(float(t))]
    assert lines == [
        (2, f"gpu_worker: {STEP} for 2 s"),
        (12, f"gpu_worker: {STEP} for 12 s"),
        (22, f"gpu_worker: {STEP} for 22 s"),
    ]
    # The next step is reported as soon as it passes the timeout.
    step = "step 18 (decode, 1 request) on the device"
    watchdog.answered(HeartbeatAck("gpu_worker", 26, step, 3.0, 2), 26.0)
    assert watchdog.reports(26.0) == [f"gpu_worker: {step} for 3 s"]


def test_systemd_is_told_all_is_well_only_while_no_child_is_stuck(monkeypatch):
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    watchdog = Watchdog(("gpu_worker",), 30.0, 60.0, long_work=("gpu_worker",), now=0.0)
    _answer_every_second(watchdog, 50, gpu_worker=(STEP, 1))  # busy, answering, not moving
    assert watchdog.notify_due(50.0)  # alive: past the heartbeat timeout, within the busy bound
    assert not watchdog.notify_due(50.5)  # every half of WatchdogSec
    _answer_every_second(watchdog, 62, gpu_worker=(STEP, 1))
    assert not watchdog.notify_due(62.0)
