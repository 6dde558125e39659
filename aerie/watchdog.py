"""The launcher's watchdog: when to send heartbeats, what each child said, and which child is
stuck (see `Watchdog`). Pure: the launcher feeds it the time and each `HeartbeatAck`."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from aerie.messages import HeartbeatAck


@dataclass
class Liveness:
    """One child as the watchdog last heard of it (times on the launcher's monotonic clock)."""

    answered: float  # when it last answered a heartbeat (before its first: when watching began)
    progressed: float  # when its progress count last moved or it was idle
    doing: str = ""  # its last answer's unit of work, "" when idle
    busy_s: float = 0.0  # how long it had been on that unit when it answered
    progress: int = -1
    reported: str = ""  # the unit of work last logged as running long
    next_report: float = 0.0  # when that unit may be logged again

    def busy_for(self, now: float) -> float:
        return self.busy_s + now - self.answered


class Watchdog:
    """When to send heartbeats, what each child said, and which child is stuck.

    Each child answers from a heartbeat thread of its own, with what its loop is doing (see
    `aerie.process.Progress`), so a busy child still answers. A child is stuck when it has
    not answered for timeout_s (stopped, or wedged so hard its thread cannot run), or when
    it has been busy with no progress for its busy bound: busy_timeout_s for the processes in
    long_work (the GPU workers, one of whose steps may legitimately run for minutes on a CPU
    or while Triton compiles), timeout_s for the others, whose units of work are short.
    Heartbeats go out every HEARTBEAT_INTERVAL_S (at most a third of the timeout). A unit of
    work that outlasts timeout_s is reported for the log, again every REPORT_EVERY_S or more.
    systemd's WatchdogSec arrives as $WATCHDOG_USEC: WATCHDOG=1 is sent every half of it while
    no child is stuck."""

    HEARTBEAT_INTERVAL_S = 1.0
    REPORT_EVERY_S = 10.0

    def __init__(
        self,
        names: tuple[str, ...],
        timeout_s: float,
        busy_timeout_s: float,
        long_work: tuple[str, ...] = (),
        now: float | None = None,
    ) -> None:
        now = time.monotonic() if now is None else now
        self.timeout_s, self.busy_timeout_s, self.long_work = timeout_s, busy_timeout_s, long_work
        self.interval_s = min(self.HEARTBEAT_INTERVAL_S, timeout_s / 3)
        self.children = {name: Liveness(answered=now, progressed=now) for name in names}
        self.seq = 0
        self._next_beat = now
        usec = os.environ.get("WATCHDOG_USEC", "")
        self.notify_interval_s = int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 else None
        self._next_notify = now

    def due(self, now: float) -> bool:
        if now < self._next_beat:
            return False
        self.seq += 1
        self._next_beat = now + self.interval_s
        return True

    def answered(self, ack: HeartbeatAck, now: float) -> None:
        child = self.children.get(ack.name)
        if child is None:
            return
        if ack.progress != child.progress or not ack.doing:
            child.progressed = now
        child.answered, child.doing, child.busy_s = now, ack.doing, ack.busy_s
        child.progress = ack.progress

    def busy_bound(self, name: str) -> tuple[float, str]:
        """(how long a unit of work may go without progress, the flag that sets it)."""
        if name in self.long_work:
            return self.busy_timeout_s, "--watchdog-busy-timeout-s"
        return self.timeout_s, "--watchdog-timeout-s"

    def stuck(self, now: float) -> tuple[str, str] | None:
        """(name, why) of the first stuck child, or None when every child is alive."""
        for name, child in self.children.items():
            silent_s = now - child.answered
            if silent_s > self.timeout_s:
                last = "idle"
                if child.doing:
                    last = f"on {child.doing}, busy for {child.busy_s:.0f} s"
                return name, (
                    f"has not answered a heartbeat for {silent_s:.0f} s (--watchdog-timeout-s "
                    f"{self.timeout_s:g}): it is stopped or wedged (at its last answer: {last})"
                )
            bound_s, flag = self.busy_bound(name)
            if child.doing and now - child.progressed > bound_s:
                return name, (
                    f"has made no progress for {now - child.progressed:.0f} s ({flag} "
                    f"{bound_s:g}) on {child.doing}, busy for {child.busy_for(now):.0f} s"
                )
        return None

    def reports(self, now: float) -> list[str]:
        """Log lines for the units of work that have run longer than timeout_s: once when they
        pass it, then every max(timeout_s, REPORT_EVERY_S)."""
        lines = []
        for name, child in self.children.items():
            if not child.doing or child.busy_s < self.timeout_s:
                continue
            if child.doing == child.reported and now < child.next_report:
                continue
            lines.append(f"{name}: {child.doing} for {child.busy_for(now):.0f} s")
            child.reported = child.doing
            child.next_report = now + max(self.timeout_s, self.REPORT_EVERY_S)
        return lines

    def notify_due(self, now: float) -> bool:
        if self.notify_interval_s is None or now < self._next_notify:
            return False
        self._next_notify = now + self.notify_interval_s
        return self.stuck(now) is None
