"""`StepProfiler`: how busy the GPU is across a window of served steps, from the profiler.

Set `AERIE_PROFILE_STEPS=FIRST,COUNT,PATH` in the environment of a launched server: the GPU
worker records the device kernels of steps FIRST .. FIRST+COUNT-1 (counted from the worker's
start, prefill steps included) with torch.profiler and writes to PATH (JSON) the number of
steps and kernels, the GPU busy time (the union of kernel intervals), the span from the first
kernel to the last, and the idle share `1 - busy / span`: the time the device waited for the
host between and inside steps. Benchmarks use it to compare the overlap schedule with
--disable-overlap-schedule; it is off unless the variable is set.
"""

from __future__ import annotations

import json
import logging
import os

log = logging.getLogger(__name__)

ENV = "AERIE_PROFILE_STEPS"


def busy_and_span_us(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(union length, first start to last end) of [start, end) intervals, in their unit."""
    if not intervals:
        return 0.0, 0.0
    intervals = sorted(intervals)
    busy, (cur_start, cur_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy, max(end for _, end in intervals) - intervals[0][0]


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
            busy, span = busy_and_span_us(
                [(e.time_range.start, e.time_range.end) for e in kernels]
            )
            summary = {"steps": self.count, "kernels": len(kernels), "gpu_busy_us": busy,
                       "span_us": span, "idle_share": 1 - busy / span if span else 0.0}  # fmt: skip
            with open(self.path, "w") as f:
                json.dump(summary, f, indent=2)
            log.info("profiled %d steps: GPU idle %.1f%% of %.1f ms", self.count,
                     100 * summary["idle_share"], span / 1e3)  # fmt: skip
            self.profile = None
