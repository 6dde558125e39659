"""`StepProfiler`: how busy the GPU is across a window of served steps, from the profiler.

Set `AERIE_PROFILE_STEPS=FIRST,COUNT,PATH` in the environment of a launched server: the GPU
worker records the device kernels of steps FIRST .. FIRST+COUNT-1 (counted from the worker's
start, prefill steps included) with torch.profiler and writes to PATH (JSON) the number of
steps and kernels, the GPU busy time (the union of kernel intervals), the span from the first
kernel to the last, and the idle share `1 - busy / span`. That idle time has two parts, also
reported: short gaps (under 4 us), one kernel of a CUDA graph starting after the previous one
ended, which only fewer kernels remove, and long gaps, where the device waited for the host
(between steps, or inside one). Benchmarks use it to compare the overlap schedule with
--disable-overlap-schedule; it is off unless the variable is set.

The profiler attaches CUPTI to the process, and PyTorch leaves it attached once it is done
(tearing it down is unsafe with CUDA graphs), so every launch after the window costs the host
more: a server profiled this way serves its later requests more slowly.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

ENV = "AERIE_PROFILE_STEPS"


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
    return DeviceGaps(busy, reach - intervals[order[0]][0], len(shorts),
                      sum(g for g, _ in shorts), len(longs), sum(g for g, _ in longs),
                      sorted(longs, reverse=True))  # fmt: skip


class StepProfiler:
    def __init__(self, first: int, count: int, path: str) -> None:
        self.first, self.count, self.path = first, count, path
        self.launched = self.finished = 0
        self.profile = None

    @classmethod
    def from_env(cls) -> StepProfiler | None:
        value = os.environ.get(ENV)
        if not value:
            return None
        try:
            first, count, path = value.split(",", 2)
            return cls(int(first), int(count), path)
        except ValueError:
            raise ValueError(f"{ENV} must be FIRST,COUNT,PATH, got {value!r}") from None

    def on_launch(self) -> None:
        """Call before launching a step."""
        if self.launched == self.first:
            from torch.profiler import ProfilerActivity, profile

            self.profile = profile(activities=[ProfilerActivity.CUDA])
            self.profile.__enter__()
        self.launched += 1

    def on_finish(self) -> None:
        """Call after finishing a step (in launch order)."""
        self.finished += 1
        if self.profile is not None and self.finished == self.first + self.count:
            import torch
            from torch.autograd import DeviceType

            torch.cuda.synchronize()
            self.profile.__exit__(None, None, None)
            kernels = [e for e in self.profile.events() if e.device_type == DeviceType.CUDA]
            gaps = device_gaps([(e.time_range.start, e.time_range.end) for e in kernels])
            busy, span = gaps.busy, gaps.span
            summary = {"steps": self.count, "kernels": len(kernels), "gpu_busy_us": busy,
                       "span_us": span, "idle_share": 1 - busy / span if span else 0.0,
                       "short_gaps": gaps.short_count, "short_gap_us": gaps.short_total,
                       "long_gaps": gaps.long_count, "long_gap_us": gaps.long_total,
                       "host_wait_share": gaps.long_total / span if span else 0.0}  # fmt: skip
            with open(self.path, "w") as f:
                json.dump(summary, f, indent=2)
            log.info("profiled %d steps: GPU idle %.1f%% of %.1f ms (waiting for the host "
                     "%.1f%%)", self.count, 100 * summary["idle_share"], span / 1e3,
                     100 * summary["host_wait_share"])  # fmt: skip
            self.profile = None


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
