"""Where a step's GPU time goes, from the profiler's device intervals.

`step_timeline` splits a step's span into busy time, short gaps (launch latency between
kernels) and long gaps (the GPU waiting for the host), at `short_us`; `between_markers` cuts a
trace of several steps at marker kernels queued around each.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.tooling.step_profile import SHORT_GAP_US, device_gaps


@dataclass(frozen=True)
class Interval:
    start: float  # microseconds
    end: float
    name: str


def between_markers(intervals: list[Interval], marker: str) -> list[list[Interval]]:
    """The intervals (any order) between consecutive pairs of marker intervals (those whose
    name contains `marker`): the first and second marker bound step 1, the third and fourth
    step 2, and so on. The caller queues a marker kernel before and after each step."""
    ordered = sorted(intervals, key=lambda i: i.start)
    steps, current = [], None
    for item in ordered:
        if marker in item.name:
            if current is None:
                current = []
            else:
                steps.append(current)
                current = None
        elif current is not None:
            current.append(item)
    return steps


def step_timeline(
    intervals: list[Interval],
    short_us: float = SHORT_GAP_US,
    longest: int = 3,
    start: float | None = None,
) -> dict:
    """One step's GPU span, busy time (the union of its intervals), and its gaps: short ones
    (count, total) and long ones (count, total, and the `longest` with the intervals around
    them), all in microseconds. start: when the device could have begun the step (the end of
    the marker before it); lead_us is then the wait for its first interval."""
    ordered = sorted(intervals, key=lambda i: (i.start, i.end))
    gaps = device_gaps([(i.start, i.end) for i in ordered], short_us)
    named = []
    for gap, after in gaps.longest[:longest]:
        before = max(ordered[:after], key=lambda i: i.end)  # the interval that ended last
        named.append({"us": gap, "after": before.name[:60], "before": ordered[after].name[:60]})
    lead = 0.0 if start is None or not ordered else ordered[0].start - start
    return {
        "span_us": gaps.span,
        "busy_us": gaps.busy,
        "lead_us": lead,
        "short_gaps": gaps.short_count,
        "short_gap_us": gaps.short_total,
        "long_gaps": gaps.long_count,
        "long_gap_us": gaps.long_total,
        "longest_gaps": named,
    }


def mean_timeline(steps: list[dict]) -> dict:
    """The numeric fields averaged over steps; the longest gaps of the first step."""
    keys = [k for k, v in steps[0].items() if isinstance(v, int | float)]
    mean = {k: sum(s[k] for s in steps) / len(steps) for k in keys}
    return {**mean, "longest_gaps": steps[0]["longest_gaps"]}
