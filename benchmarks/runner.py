"""Running a suite of `python3 -m benchmarks`: its steps in order, each command's output in a log
under the out directory, the end of that log printed when the command ends.

A step is a `Command` (a subprocess), a `Server` (a launched `launch.py` serving the steps
inside it, stopped with SIGTERM after them) or a `Call` (Python in this process: copying files,
merging result files). `Runner.run` stops at the first failing step unless told to keep going;
`dry_run_lines` is what `--dry-run` prints: one shell-quoted line per command, `# ...` for a call.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
STOP_TIMEOUT_S = 120.0


@dataclass
class Command:
    """A subprocess run from the repository root (or `cwd`), stdout and stderr into `out/log`.
    `during`, when set, runs in a thread while the process runs (a host profiler attaching)."""

    argv: list[str]
    log: str
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    cwd: str | None = None
    during: Callable[[subprocess.Popen], None] | None = None
    during_text: str = ""


@dataclass
class Server:
    """`argv` (a `launch.py` command) in the background until GET /health on `port` answers 200;
    then `steps`; then SIGTERM, which drains it."""

    argv: list[str]
    log: str
    port: int
    steps: list[Step]
    env: dict[str, str] = field(default_factory=dict)
    start_timeout_s: float = 240.0


@dataclass
class Call:
    """Python run in this process; `text` is its line in a dry run."""

    text: str
    fn: Callable[[], None]


Step = Command | Server | Call


class SuiteError(Exception):
    """A suite cannot be planned from these flags and files; the message says why."""


class Terminated(BaseException):
    """The suite got SIGTERM (a `timeout` around it, say): raised where it waits, so that the
    server and the command it runs are stopped on the way out, not left holding the GPU and
    the port for whatever runs next. Not an Exception: a step's own error handling lets it
    through."""


def raise_terminated(signum: int, frame: object) -> None:
    """The SIGTERM handler: once. A second SIGTERM while servers stop is ignored, so it cannot
    cut their stop short (the caller restores the handler it replaced)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated


def command_line(cmd: Command) -> str:
    line = shlex.join([f"{k}={v}" for k, v in cmd.env.items()] + cmd.argv)
    return f"(cd {shlex.quote(cmd.cwd)} && {line})" if cmd.cwd else line


def server_line(server: Server) -> str:
    return shlex.join([f"{k}={v}" for k, v in server.env.items()] + server.argv) + " &"


def dry_run_lines(steps: Sequence[Step]) -> list[str]:
    lines: list[str] = []
    for step in steps:
        if isinstance(step, Command):
            lines.append(command_line(step))
            if step.during_text:
                lines.append(f"# while it runs: {step.during_text}")
        elif isinstance(step, Server):
            lines.append(server_line(step))
            lines += dry_run_lines(step.steps)
        else:
            lines.append(f"# {step.text}")
    return lines


def tail_lines(path: str, num: int) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-num:] if num > 0 else []
    except OSError:
        return []


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (a server drains its requests and stops its processes), then the whole session
    killed if it has not exited in time."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            kill_session(proc)


def kill_session(proc: subprocess.Popen) -> None:
    """Kill the process and whatever it started (it leads a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class Runner:
    """Runs steps with `env` under the out directory; `failures` names each failed step."""

    def __init__(self, out: str, env: dict[str, str], keep_going: bool, tail: int) -> None:
        self.out, self.env, self.keep_going, self.tail = out, env, keep_going, tail
        self.failures: list[str] = []

    def run(self, steps: Sequence[Step]) -> bool:
        """Whether every step ran; stops at the first failure unless keeping going."""
        ok = True
        for step in steps:
            if not self.run_step(step):
                ok = False
                if not self.keep_going:
                    return False
        return ok

    def fail(self, message: str) -> bool:
        print(f"benchmarks: {message}", file=sys.stderr, flush=True)
        self.failures.append(message)
        return False

    def run_step(self, step: Step) -> bool:
        if isinstance(step, Command):
            return self.run_command(step)
        if isinstance(step, Server):
            return self.run_server(step)
        print(f"== {step.text}", flush=True)
        try:
            step.fn()
        except (Exception, SystemExit) as e:  # a failed call fails its step, as a command's exit
            return self.fail(f"step failed ({type(e).__name__}: {e}): {step.text}")
        return True

    def run_command(self, cmd: Command) -> bool:
        line = command_line(cmd)
        print(f"== {line}", flush=True)
        log_path = os.path.join(self.out, cmd.log)
        start = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                cmd.argv,
                cwd=cmd.cwd or REPO_ROOT,
                env={**self.env, **cmd.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a timeout stops what it started too
            )
        watcher = threading.Thread(target=cmd.during, args=(proc,), daemon=True)
        if cmd.during is not None:
            watcher.start()
        try:
            rc = proc.wait(cmd.timeout_s)
        except subprocess.TimeoutExpired:
            kill_session(proc)
            rc = None
        except BaseException:  # the suite is stopped (`Terminated`): so is what it started
            kill_session(proc)
            raise
        if watcher.is_alive():
            watcher.join(STOP_TIMEOUT_S)
        for text in tail_lines(log_path, self.tail):
            print(f"  {text}")
        took = time.monotonic() - start
        if rc is None:
            return self.fail(f"step timed out after {cmd.timeout_s:g} s: {line} (log: {log_path})")
        if rc != 0:
            return self.fail(f"step failed (exit {rc}): {line} (log: {log_path})")
        print(f"   ok, {took:.1f} s", flush=True)
        return True

    def run_server(self, server: Server) -> bool:
        line = server_line(server)
        print(f"== {line}", flush=True)
        log_path = os.path.join(self.out, server.log)
        with socket.socket() as sock:  # else the health check would find that one
            if sock.connect_ex(("127.0.0.1", server.port)) == 0:
                return self.fail(f"something already listens on port {server.port}: {line}")
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                server.argv,
                cwd=REPO_ROOT,
                env={**self.env, **server.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            problem = wait_healthy(proc, server.port, server.start_timeout_s)
            if problem:
                for text in tail_lines(log_path, self.tail):
                    print(f"  {text}")
                return self.fail(f"server did not start ({problem}): {line} (log: {log_path})")
            return self.run(server.steps)
        finally:
            stop_server(proc)
            print(f"   server stopped (exit {proc.returncode})", flush=True)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> str:
    """'' once GET /health answers 200, else what went wrong."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return ""
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    return f"not healthy within {timeout_s:.0f} s"


def setup_env(script: str) -> dict[str, str]:
    """Run the device staging script (carried wheels installed, model halves joined) and return
    the variables it prints as `export K=V` lines."""
    print(f"== bash {shlex.quote(script)}", flush=True)
    result = subprocess.run(["bash", script], cwd=REPO_ROOT, capture_output=True, text=True)
    exports = {}
    for text in result.stdout.splitlines():
        if text.startswith("export ") and "=" in text:
            key, _, value = text.removeprefix("export ").partition("=")
            exports[key.strip()] = value.strip()
        else:
            print(f"  {text}")
    if result.returncode != 0:
        raise SuiteError(f"setup failed (exit {result.returncode}): {script}\n{result.stderr}")
    return exports
