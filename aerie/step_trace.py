"""`StepTrace`: when each served step passes through the scheduler and the GPU worker, as host
timestamps on one clock (benchmarks and diagnosis only; off unless `AERIE_STEP_TRACE` is set).
The events and how to read them: `docs/serving.md`; `tools/step_trace_summary.py` merges the
files into one timeline.
"""

from __future__ import annotations

import json
import logging
import os
import time

log = logging.getLogger(__name__)

ENV = "AERIE_STEP_TRACE"


def window_from_env(env: str) -> tuple[int, int, str] | None:
    """FIRST,COUNT,DIR from the variable `env` (DIR created), or None when it is not set: the
    window of plans a benchmark-only recorder covers (this trace, `aerie.host_profile`)."""
    value = os.environ.get(env)
    if not value:
        return None
    try:
        first, count, directory = value.split(",", 2)
        window = int(first), int(count), directory
    except ValueError as e:
        raise ValueError(f"{env}={value!r}: expected FIRST,COUNT,DIR ({e})") from None
    if window[0] < 1 or window[1] < 1 or not directory:  # before anything is created
        raise ValueError(f"{env}={value!r}: FIRST and COUNT must be >= 1, DIR not empty")
    os.makedirs(directory, exist_ok=True)
    return window


class StepTrace:
    def __init__(self, process: str, first: int, count: int, directory: str) -> None:
        """first, count: a window `window_from_env` checked (first and count >= 1)."""
        self.process, self.directory = process, directory
        self.first, self.end = first, first + count
        self.events: list[tuple[str, int, float]] = []  # (event, plan id, monotonic ns)
        self.plans: dict[int, tuple[str, int]] = {}  # plan id -> (mode, batch size)
        self.written = False

    @classmethod
    def from_env(cls, process: str) -> StepTrace | None:
        """The trace `AERIE_STEP_TRACE` asks for, or None when it is not set."""
        window = window_from_env(ENV)
        return None if window is None else cls(process, *window)

    def mark(self, event: str, plan_id: int) -> None:
        """Record `event` of plan `plan_id` now; past the window, write the file once."""
        if plan_id < self.first:
            return
        if plan_id >= self.end:
            self.write()
            return
        self.events.append((event, plan_id, time.monotonic_ns()))

    def value(self, name: str, plan_id: int, value: float) -> None:
        """Record a measured quantity of plan `plan_id` (kept with the events; by convention
        its name ends in its unit, e.g. `gpu_gap_us`)."""
        if self.first <= plan_id < self.end:
            self.events.append((name, plan_id, value))

    def plan(self, plan_id: int, mode: str, batch_size: int) -> None:
        """Keep a sent plan's mode and batch size (the scheduler's side)."""
        if self.first <= plan_id < self.end:
            self.plans[plan_id] = (mode, batch_size)

    @property
    def path(self) -> str:
        return os.path.join(self.directory, f"{self.process}.json")

    def write(self) -> None:
        """Write what was recorded (once; later calls do nothing)."""
        if self.written:
            return
        self.written = True
        with open(self.path, "w") as f:
            json.dump(
                {
                    "process": self.process,
                    "events": self.events,
                    "plans": {str(k): v for k, v in self.plans.items()},
                },
                f,
            )
        log.info("step trace: %d events written to %s", len(self.events), self.path)
