"""`StepProfiler`: how busy the GPU is across a window of served steps.

`AERIE_PROFILE_STEPS=FIRST,COUNT,PATH` traces steps FIRST .. FIRST+COUNT-1 (counted from the
worker's start) and writes their busy time, span and idle share to PATH as JSON;
`AERIE_PROFILE_TRACER` picks `graphs` (CUPTI, one record per graph launch, the default) or
`kernels` (torch.profiler, which costs the host enough to skew the idle share it reads).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gpu_worker.tooling.cupti_trace import GraphTrace

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENV = "AERIE_PROFILE_STEPS"
TRACER_ENV = "AERIE_PROFILE_TRACER"
TRACERS = ("graphs", "kernels")


SHORT_GAP_US = 4.0  # below this, a gap is one kernel node following another


@dataclass(frozen=True)
class DeviceGaps:
    """busy: the union of the intervals; span: first start to last end; short / long: the
    gaps between them under / over SHORT_GAP_US (count and total); longest: the long gaps as
    (length, index of the interval after the gap in start order), longest first. One unit."""

    busy: float
    span: float
    short_count: int
    short_total: float
    long_count: int
    long_total: float
    longest: list[tuple[float, int]]


def device_gaps(intervals: list[tuple[float, float]], short: float = SHORT_GAP_US) -> DeviceGaps:
    """The gaps of [start, end) intervals on one device (any order; overlaps leave none)."""
    if not intervals:
        return DeviceGaps(0.0, 0.0, 0, 0.0, 0, 0.0, [])
    order = sorted(range(len(intervals)), key=lambda k: intervals[k])
    busy, shorts, longs = 0.0, [], []
    run_start, reach = intervals[order[0]]
    for position, k in enumerate(order[1:], start=1):
        start, end = intervals[k]
        if start > reach:
            busy += reach - run_start
            gap = start - reach
            (shorts if gap < short else longs).append((gap, position))
            run_start = start
        reach = max(reach, end)
    busy += reach - run_start
    return DeviceGaps(
        busy,
        reach - intervals[order[0]][0],
        len(shorts),
        sum(g for g, _ in shorts),
        len(longs),
        sum(g for g, _ in longs),
        sorted(longs, reverse=True),
    )


class KernelTrace:
    """torch.profiler's CUDA kernels, with GraphTrace's interface."""

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.profile = profile(activities=[ProfilerActivity.CUDA])
        self.profile.__enter__()

    def window(self) -> None:
        """Nothing to do: this trace starts with the window."""

    def stop(self) -> tuple[list[tuple[float, float]], dict[str, int]]:
        from torch.autograd import DeviceType

        self.profile.__exit__(None, None, None)
        kernels = [e for e in self.profile.events() if e.device_type == DeviceType.CUDA]
        return [(e.time_range.start, e.time_range.end) for e in kernels], {"kernel": len(kernels)}


def profile_summary(
    steps: int, tracer: str, intervals: list[tuple[float, float]], records: dict[str, int]
) -> dict:
    """The JSON a profiled window writes (idle share: 1 - busy / span)."""
    gaps = device_gaps(intervals)
    busy, span = gaps.busy, gaps.span
    return {
        "steps": steps,
        "tracer": tracer,
        "records": records,
        "gpu_busy_us": busy,
        "span_us": span,
        "idle_share": 1 - busy / span if span else 0.0,
        "short_gaps": gaps.short_count,
        "short_gap_us": gaps.short_total,
        "long_gaps": gaps.long_count,
        "long_gap_us": gaps.long_total,
        "host_wait_share": gaps.long_total / span if span else 0.0,
    }


class StepProfiler:
    """Create it before the worker captures its CUDA graphs: the `graphs` tracer records from
    then on (see `cupti_trace.GraphTrace`) and keeps only the window's records."""

    def __init__(self, first: int, count: int, path: str, tracer: str = "graphs") -> None:
        if tracer not in TRACERS:
            raise ValueError(f"{TRACER_ENV} must be one of {', '.join(TRACERS)}, got {tracer!r}")
        if first < 0 or count < 1:
            raise ValueError(f"{ENV}: FIRST must be >= 0 and COUNT >= 1, got {first}, {count}")
        self.first, self.count, self.path, self.tracer = first, count, path, tracer
        self.launched = self.finished = 0
        self.modes: Counter = Counter()  # the window's steps by mode
        self.rows = 0  # and their requests
        self.trace: GraphTrace | KernelTrace | None = None
        if tracer == "graphs":
            self.trace = GraphTrace()
            self.trace.start()

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        try:
            first, count, path = value.split(",", 2)
            first_step, steps = int(first), int(count)
        except ValueError:
            raise ValueError(f"{ENV} must be FIRST,COUNT,PATH, got {value!r}") from None
        return cls(first_step, steps, path, os.environ.get(TRACER_ENV, "graphs"))

    def on_launch(self, mode: str = "decode", batch_size: int = 0) -> None:
        """Call before launching a step (its plan's mode and number of requests)."""
        if self.first <= self.launched < self.first + self.count:
            self.modes[mode] += 1
            self.rows += batch_size
        if self.launched == self.first:
            if self.trace is None:
                self.trace = KernelTrace()
                self.trace.start()
            self.trace.window()
        self.launched += 1

    def on_finish(self) -> None:
        """Call after finishing a step (in launch order)."""
        self.finished += 1
        if self.trace is not None and self.finished == self.first + self.count:
            import torch

            torch.cuda.synchronize()
            trace, self.trace = self.trace, None
            try:  # a benchmark's measurement: its failure must not stop the server
                intervals, records = trace.stop()
                summary = profile_summary(self.count, self.tracer, intervals, records)
                summary["untraced"] = getattr(trace, "refused", [])  # kinds CUPTI refused
                summary.update(modes=dict(self.modes), mean_batch_size=self.rows / self.count)
                with open(self.path, "w") as f:
                    json.dump(summary, f, indent=2)
            except Exception:
                log.exception(
                    "the profiled window of steps %d..%d was lost",
                    self.first,
                    self.first + self.count - 1,
                )
                return
            log.info(
                "profiled %d steps (%s): GPU idle %.1f%% of %.1f ms (waiting for the host %.1f%%)",
                self.count,
                self.tracer,
                100 * summary["idle_share"],
                summary["span_us"] / 1e3,
                100 * summary["host_wait_share"],
            )


class StepClock:
    """CUDA events around every launched step, read when it finishes: how long the device sat
    idle between the previous step's last operation and this step's first (`gap`, waiting for
    the host to launch it) and how long it took from its first operation to its last (`span`).
    No profiler, so no CUPTI cost; the step trace records both (benchmarks only)."""

    def __init__(self) -> None:
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event | None]] = {}
        self.last_end: torch.cuda.Event | None = None

    @staticmethod
    def _record() -> torch.cuda.Event:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self, plan_id: int) -> None:
        """Before the step's first device operation is queued."""
        self.events[plan_id] = (self._record(), None)

    def end(self, plan_id: int) -> None:
        """After its last one is queued."""
        self.events[plan_id] = (self.events[plan_id][0], self._record())

    def finished(self, plan_id: int) -> tuple[float | None, float]:
        """(gap, span) of a finished step in microseconds (steps finish in launch order; the
        first step has no gap)."""
        start, end = self.events.pop(plan_id)
        assert end is not None, f"step {plan_id} was not ended"
        end.synchronize()
        gap = None if self.last_end is None else 1e3 * self.last_end.elapsed_time(start)
        self.last_end = end
        return gap, 1e3 * start.elapsed_time(end)
