"""Launch `python launch.py ...` as a user would, wait for /health, and stop it; helpers to
find and check its child processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from aerie.process import process_alive

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_args() -> list[str]:
    """`--device cpu` by default; AERIE_E2E_DEVICE=cuda runs the same tests on a GPU in float32
    (so greedy parity with the float32 transformers reference still holds)."""
    device = os.environ.get("AERIE_E2E_DEVICE", "cpu")
    return ["--device", device] + (["--dtype", "float32"] if device != "cpu" else [])


READY_LINE = re.compile(r"Aerie is ready: (http://\S+) \(ZMQ (tcp://\S+)\)")


def child_pids(pid: int) -> list[int]:
    """Direct children of pid (Linux /proc)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except FileNotFoundError:
            pass
    return children


def child_named(server: Server, name: str) -> int:
    """The pid of child `name`: children name themselves `aerie-<name>` (15 bytes at most, so
    every frontend shows as "aerie-tokenizer": "tokenizer1" is the second of them, in the
    order the launcher started them)."""
    frontend = re.fullmatch(r"tokenizer(\d*)", name)
    nth = int(frontend.group(1) or 0) if frontend else 0
    for pid in server.children:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == f"aerie-{name}"[:15]:
                if nth == 0:
                    return pid
                nth -= 1
    raise AssertionError(f"no child for {name}: {server.children}")


def frontend_args(args: tuple[str, ...]) -> list[str]:
    """`--tokenizer-worker-num` from AERIE_E2E_FRONTENDS (default 2: every launched test runs
    behind two frontends sharing the port, as a server on a machine of 8 or more cores does;
    1 for one) unless the test chose its own."""
    if "--tokenizer-worker-num" in args:
        return []
    return ["--tokenizer-worker-num", os.environ.get("AERIE_E2E_FRONTENDS", "2")]


def assert_no_orphans(server: Server, timeout_s: float = 5.0) -> None:
    """Every child of the launcher is gone (polled: a killed process takes a moment to reap)."""
    deadline = time.monotonic() + timeout_s
    while [p for p in server.children if process_alive(p)]:
        assert time.monotonic() < deadline, "orphaned children"
        time.sleep(0.05)


class Server:
    """`python launch.py --port 0 ...`: the OS picks free HTTP and ZMQ ports at bind time (no
    race with other processes for a port chosen in advance); the addresses come from the
    launcher's ready line."""

    def __init__(self, *args: str, startup_timeout_s: float = 300.0, env: dict | None = None):
        self.url = ""
        self.zmq_address = ""
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="aerie-e2e-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "launch.py", "--port", "0", *device_args(), *frontend_args(args)]
        cmd += args
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self._wait_healthy(startup_timeout_s)
        self.children = child_pids(self.proc.pid)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            ready = READY_LINE.search(self.log_text())
            if ready is not None:
                self.url, self.zmq_address = ready.group(1), ready.group(2)
                try:
                    if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not healthy within {timeout_s} s:\n{self.log_text()}")

    def log_text(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-20000:]

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for pid in getattr(self, "children", []):
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
