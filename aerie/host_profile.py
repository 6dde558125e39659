"""`HostProfile`: where a served step's host time goes, function by function, by cProfile in the
scheduler and the GPU worker (rank 0) over a window of plans (benchmarks and diagnosis only;
off unless `AERIE_HOST_PROFILE=FIRST,COUNT,DIR` is set). Each writes `DIR/<process>.pstats`
and a summary per plan in `DIR/<process>.txt`. Its times read high; its call counts are exact.
"""

from __future__ import annotations

import cProfile
import io
import logging
import os
import pstats

from aerie.step_trace import window_from_env

log = logging.getLogger(__name__)

ENV = "AERIE_HOST_PROFILE"
TOP = 45  # functions listed per ordering in the text summary


class HostProfile:
    def __init__(self, process: str, first: int, count: int, directory: str) -> None:
        """first, count: a window `window_from_env` checked (first and count >= 1)."""
        self.process, self.directory = process, directory
        self.first, self.end = first, first + count
        self.profiler: cProfile.Profile | None = None
        self.plans: set[int] = set()  # the window's plans seen (a shutdown may cut it short)
        self.written = False

    @classmethod
    def from_env(cls, process: str) -> HostProfile | None:
        """The profile `AERIE_HOST_PROFILE` asks for, or None when it is not set."""
        window = window_from_env(ENV)
        return None if window is None else cls(process, *window)

    def at(self, plan_id: int) -> None:
        """The process has reached plan `plan_id`: profiling starts at FIRST and ends (the
        files written, once) at the first plan past the window."""
        if self.written or plan_id < self.first:
            return
        if plan_id >= self.end:
            self.write()
            return
        self.plans.add(plan_id)
        if self.profiler is None:
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def write(self) -> None:
        """Stop and write what was profiled (once; nothing when the window never opened)."""
        if self.written or self.profiler is None:
            return
        self.written = True
        self.profiler.disable()
        base = os.path.join(self.directory, self.process)
        self.profiler.dump_stats(base + ".pstats")
        with open(base + ".txt", "w") as f:
            f.write(summary(pstats.Stats(self.profiler), len(self.plans)))
        log.info("host profile of %d plans written to %s.{pstats,txt}", len(self.plans), base)


def summary(stats: pstats.Stats, plans: int) -> str:
    """The top functions by own and by cumulative time, per plan."""
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        where = f"{os.path.basename(path)}:{line}" if line else path
        rows.append((own, cumulative, calls, f"{where}({name})"))
    out = io.StringIO()
    total = sum(row[0] for row in rows)
    out.write(f"{plans} plans, {total / plans * 1e6:.1f} us of profiled host time per plan\n")
    for title, key in (("own time", 0), ("cumulative time", 1)):
        out.write(f"\nby {title}: us/plan (own, cumulative), calls/plan, function\n")
        for own, cumulative, calls, name in sorted(rows, key=lambda r: -r[key])[:TOP]:
            per = 1e6 / plans
            out.write(f"{own * per:9.1f} {cumulative * per:9.1f} {calls / plans:8.2f}  {name}\n")
    return out.getvalue()
