"""Where a served run's CPU goes: each Aerie process's CPU time over the run, beside the client's.

Aerie's processes name themselves `aerie-<name>` (`aerie.process.die_with_parent`), so a
benchmark on the server's machine finds them by name in /proc, named as `ps` shows them: Linux
keeps 15 bytes, so the GPU worker is "gpu_worke", and every frontend ("tokenizer", "tokenizer1",
...) is "tokenizer", told apart in pid order as "tokenizer", "tokenizer#2" and so on. A
process's share is its CPU seconds (user and system) over the run's wall seconds: 1.0 is one
core busy the whole run, the sign of a process that paces the rest.
"""

from __future__ import annotations

import os
import time

PREFIX = "aerie-"
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def aerie_processes(proc: str = "/proc") -> dict[str, int]:
    """name -> pid of every process named aerie-<name> (a name seen again gets "#2", "#3"...,
    in pid order); empty without /proc."""
    found: dict[str, int] = {}
    try:
        pids = sorted(int(entry) for entry in os.listdir(proc) if entry.isdigit())
    except OSError:
        return found
    for pid in pids:
        try:
            with open(f"{proc}/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:  # gone meanwhile
            continue
        if comm.startswith(PREFIX):
            name, count = comm.removeprefix(PREFIX), 1
            while (name if count == 1 else f"{name}#{count}") in found:
                count += 1
            found[name if count == 1 else f"{name}#{count}"] = pid
    return found


def cpu_seconds(pid: int, proc: str = "/proc") -> float | None:
    """User plus system CPU seconds of a process so far; None once it is gone."""
    try:
        with open(f"{proc}/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state is field 3
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime: fields 14, 15


class CpuMeter:
    """The Aerie processes' CPU over a run: made at its start, `shares()` at its end."""

    def __init__(self, proc: str = "/proc") -> None:
        self.proc = proc
        self.pids = aerie_processes(proc)
        self.start = {name: cpu_seconds(pid, proc) for name, pid in self.pids.items()}
        self.wall = time.perf_counter()

    def shares(self) -> dict[str, float]:
        """name -> CPU seconds over wall seconds since the start (processes that ended are
        left out)."""
        wall = max(time.perf_counter() - self.wall, 1e-9)
        out = {}
        for name, pid in self.pids.items():
            now, then = cpu_seconds(pid, self.proc), self.start[name]
            if now is not None and then is not None:
                out[name] = round((now - then) / wall, 3)
        return out
