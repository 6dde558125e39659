"""Host profiles with py-spy while a benchmark runs (suites `serving` and `iteration` with
`--pyspy-seconds`): raw samples of each process recorded side by side, then summarised by
tools/profile_summary.py into one text file per run (the raw files are removed: large, and
the summary is what is read).

py-spy comes from the carried wheels (`python3 -m benchmarks prepare` downloads it; the
device's `--setup` installs it under ~/aerie-site), or from PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable

from benchmarks.process_cpu import aerie_processes
from benchmarks.runner import PYTHON, REPO_ROOT

Hook = Callable[[subprocess.Popen], None]
RATE = 250  # samples/s
SERVER_PROCESSES = ("gpu_worke", "scheduler")  # comm: 15 bytes
# Every frontend ("tokenizer", "tokenizer1", ...): all named "aerie-tokenizer" in 15 bytes, so
# `aerie_processes` tells them apart as "tokenizer", "tokenizer#2", ...
FRONTEND_PREFIX = "tokenizer"


def server_pids(found: dict[str, int]) -> dict[str, int]:
    """The server processes to profile among `aerie_processes()`: SERVER_PROCESSES and every
    frontend."""
    pids = {name: found[name] for name in SERVER_PROCESSES if name in found}
    pids.update({name: pid for name, pid in found.items() if name.startswith(FRONTEND_PREFIX)})
    return pids


def pyspy_binary() -> str:
    return shutil.which("py-spy") or os.path.expanduser("~/aerie-site/bin/py-spy")


def record(pids: dict[str, int], seconds: float, out_dir: str, prefix: str) -> list[str]:
    """py-spy on every pid at once for `seconds`; the raw files written."""
    spies, paths = [], []
    for name, pid in pids.items():
        path = os.path.join(out_dir, f"{prefix}_{name}.txt")
        argv = [pyspy_binary(), "record", "-p", str(pid), "-d", str(int(seconds))]
        argv += ["-r", str(RATE), "-f", "raw", "--threads", "--idle", "--nonblocking", "-o", path]
        spies.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        paths.append(path)
    for spy in spies:
        spy.wait()
    return [p for p in paths if os.path.isfile(p)]


def summarise(paths: list[str], seconds: float, summary_path: str, header: str = "") -> None:
    """tools/profile_summary.py over the raw files into `summary_path`; the raw files removed."""
    argv = [PYTHON, "tools/profile_summary.py", "--rate", str(RATE), "--seconds", str(int(seconds))]
    with open(summary_path, "w") as f:
        if header:
            f.write(header + "\n")
            f.flush()
        subprocess.run(argv + paths, cwd=REPO_ROOT, stdout=f, stderr=subprocess.STDOUT)
    for path in paths:
        os.remove(path)


def write_failure(summary_path: str, error: OSError) -> None:
    with open(summary_path, "w") as f:
        f.write(f"no host profile: {error}\n")


def num_running(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as r:
            return int(json.load(r).get("num_running", 0))
    except (OSError, ValueError):
        return 0


def profile_serving(port: int, concurrency: int, seconds: float, summary_path: str) -> Hook:
    """A `Command.during` hook: once half of `concurrency` streams run (the steady state), every
    server process and the client for `seconds`, summarised into `summary_path`."""

    def hook(client: subprocess.Popen) -> None:
        deadline = time.monotonic() + 60
        while client.poll() is None and time.monotonic() < deadline:
            if 2 * num_running(port) >= concurrency:
                break
            time.sleep(0.1)
        time.sleep(1)
        if client.poll() is not None:
            return
        pids = server_pids(aerie_processes())
        pids["client"] = client.pid
        try:
            paths = record(pids, seconds, os.path.dirname(summary_path), "spy")
        except OSError as e:  # the measurement goes on without its profile
            return write_failure(summary_path, e)
        summarise(paths, seconds, summary_path)

    return hook


def profile_spins(log_path: str, seconds: float, summary_prefix: str) -> Hook:
    """A `Command.during` hook for `bench_speculative.py --spin`: each time the benchmark prints
    "spinning ... pid N" (it then repeats one step for `seconds`), that process for a second
    less, summarised into `<summary_prefix>_<n>.txt`."""

    def hook(bench: subprocess.Popen) -> None:
        seen = 0
        while bench.poll() is None:
            with open(log_path, errors="replace") as f:
                spins = [line.strip() for line in f if line.startswith("spinning")]
            if len(spins) > seen:
                seen = len(spins)
                pid = int(spins[-1].rsplit(" ", 1)[1])
                summary = f"{summary_prefix}_{seen}.txt"
                try:
                    paths = record({"iter": pid}, seconds - 1, os.path.dirname(summary), "spy")
                except OSError as e:
                    return write_failure(summary, e)
                summarise(paths, seconds - 1, summary, f"== {spins[-1]}")
            time.sleep(0.2)

    return hook
