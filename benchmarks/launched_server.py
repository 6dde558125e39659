"""A server launched as a user launches one: `python launch.py ...` from the repository root as
a subprocess, its output in a log file, ready once its ready line is logged and `GET /health`
answers 200; stopped with SIGTERM (which drains), killed only if it does not exit in time.

The ports asked for must be free (HTTP and ZMQ, port + 1): a server already listening there
would otherwise be the one measured. `--port 0` lets the OS pick; the URL comes from the
launcher's ready line either way.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_LINE = re.compile(r"Aerie is ready: (http://\S+) ")


class LaunchError(RuntimeError):
    """A server did not come up; the message has the end of its log."""


class LaunchedServer:
    """`python launch.py ...` in the repository, its output in `log_path`; `url` once healthy."""

    def __init__(
        self, cmd: list[str], log_path: str, timeout_s: float, env: dict[str, str] | None = None
    ) -> None:
        """env: more environment for the server's processes."""
        self.log_path = log_path
        self.url = ""
        port = int(cmd[cmd.index("--port") + 1])
        for p in (port, port + 1) if port else ():
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", p)) == 0:
                    raise LaunchError(f"something already listens on port {p}: pass --port")
        # NOTE: a key in the environment would make the server refuse this client; it serves
        # loopback only, so none is needed.
        env = {**{k: v for k, v in os.environ.items() if k != "AERIE_API_KEY"}, **(env or {})}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        try:
            self._wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"the server exited with {self.proc.returncode}:\n{self.tail()}")
            ready = READY_LINE.search(self.tail(None))
            if ready is not None:
                try:
                    if httpx.get(ready[1] + "/health", timeout=5).status_code == 200:
                        self.url = ready[1]
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        raise LaunchError(f"the server was not healthy within {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, num_chars: int | None = 3000) -> str:
        """The end of the log (None: all of it)."""
        with open(self.log_path, errors="replace") as f:
            text = f.read()
        return text[-num_chars:] if num_chars else text

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
