"""Launch `python launch.py ...` as a user would, wait for /health, and stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def device_args() -> list[str]:
    """`--device cpu` by default; AERIE_E2E_DEVICE=cuda runs the same tests on a GPU in float32
    (so greedy parity with the float32 transformers reference still holds)."""
    device = os.environ.get("AERIE_E2E_DEVICE", "cpu")
    return ["--device", device] + (["--dtype", "float32"] if device != "cpu" else [])


def free_port_pair() -> int:
    """A port p such that p (HTTP) and p + 1 (ZMQ) are both free right now."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


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


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


class Server:
    def __init__(self, *args: str, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port_pair()
        self.url = f"http://127.0.0.1:{self.port}"
        self.zmq_address = f"tcp://127.0.0.1:{self.port + 1}"
        self.log = tempfile.NamedTemporaryFile(
            "w+", prefix="aerie-e2e-", suffix=".log", delete=False
        )
        cmd = [sys.executable, "launch.py", "--port", str(self.port), *device_args(), *args]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy()
        )
        self._wait_healthy(startup_timeout_s)
        self.children = child_pids(self.proc.pid)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
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
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
