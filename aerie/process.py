"""Process bootstrap shared by the `run_<name>_process` entry points (frontend, scheduler,
GPU worker).

`run_process` sets up logging, ties the child's life to the launcher's, builds its core, freezes
what startup allocated out of the garbage collector's walks (`gc_policy`), starts its
`HeartbeatThread` (its own socket and ZMQ context, so a loop inside a long step still
answers), reports `ProcessReady`, runs the loop, and reports `ProcessFailed` on any exception.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.gc_policy import freeze_startup
from aerie.logging import setup_logging
from aerie.messages import Heartbeat, HeartbeatAck, ProcessFailed, ProcessReady
from aerie.transport import Receiver, Sender

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class Progress:
    """What a process's loop is doing, written by the loop, read by its heartbeat thread.

    The loop calls `begin(what)` when it starts a unit of work, `advance()` when the unit
    moves on, and `end()` when it waits for messages again. Each call moves the progress count,
    so a count that stands still while busy means no progress. `what` is formatted by
    `describe` only when a heartbeat asks, never on the loop's path. Only the loop writes; the
    state is one tuple replaced whole, so a reader always sees a consistent snapshot."""

    def __init__(self, describe: Callable[[Any], str] = str) -> None:
        self.describe = describe
        self.state: tuple[Any, float, int] = (None, 0.0, 0)  # (what or None: idle, since, count)

    def begin(self, what: Any, since: float | None = None) -> None:
        """Start `what` (at `since` on the monotonic clock, default now)."""
        self.state = (what, time.monotonic() if since is None else since, self.state[2] + 1)

    def advance(self) -> None:
        what, since, count = self.state
        self.state = (what, since, count + 1)

    def end(self) -> None:
        self.state = (None, 0.0, self.state[2] + 1)

    def snapshot(self) -> tuple[str, float, int]:
        """(what it is doing, "" when idle; for how many seconds; progress count)."""
        what, since, count = self.state
        if what is None:
            return "", 0.0, count
        return self.describe(what), time.monotonic() - since, count


class HeartbeatThread(threading.Thread):
    """Answers the launcher's heartbeats with the loop's `Progress`, on a socket and ZMQ
    context of its own (sockets are not shared between threads). A stopped or hard-wedged
    process stops answering; a busy one answers and says what it is busy with."""

    POLL_S = 0.2  # how often it checks whether it should stop

    def __init__(self, config: AerieConfig, name: str, progress: Progress) -> None:
        super().__init__(name=f"{name}-heartbeat", daemon=True)
        self.process_name, self.progress = name, progress
        self.context = zmq.Context()
        # Bound here, so a failure to bind is the process's start-up failure.
        self.inbox = Receiver(endpoints.heartbeat(config, name), self.context)
        self.launcher = Sender(endpoints.inbox(config, "launcher"), self.context)
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            message = self.inbox.recv(timeout_s=self.POLL_S)
            if isinstance(message, Heartbeat):
                doing, busy_s, count = self.progress.snapshot()
                ack = HeartbeatAck(self.process_name, message.seq, doing, busy_s, count)
                self.launcher.send(ack)
        self.inbox.close()
        self.launcher.close()
        self.context.term()

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=2 * self.POLL_S + 1)


def process_alive(pid: int) -> bool:
    """Whether process pid exists and is not a zombie (a dead child its parent has not reaped
    yet still answers signal 0, so /proc decides on Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # NOTE: the state follows the parenthesised command name, which may hold spaces.
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def die_with_parent(name: str, death_signal: int = signal.SIGKILL) -> None:
    """Ask Linux to send death_signal (SIGKILL: no orphans, whatever the child is doing) to this
    process when its parent (the launcher) dies, and name it `aerie-<name>` (first 15 bytes)
    so `ps`/`top` show which process is which."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, death_signal)
        libc.prctl(_PR_SET_NAME, f"aerie-{name}".encode()[:15])
    except OSError:
        pass
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os._exit(1)


def report_failure(address: str, failure: ProcessFailed) -> None:
    """Deliver the failure before the process exits: closing a socket only hands its queue to
    ZMQ's I/O thread, which os._exit would kill, so the report goes out on a context of its own
    whose termination waits (up to the linger) until the message has left."""
    context = zmq.Context()
    sender = Sender(address, context)
    sender.send(failure)
    sender.close()
    context.term()


def _orphan_exit(launcher_pid: int, on_parent_death: Callable[[], None] | None):
    """The children's SIGTERM handler: ignored while the launcher lives; after it, the cleanup
    and exit."""
    if on_parent_death is None:
        return signal.SIG_IGN

    def handle(signum: int, frame: object) -> None:
        if os.getppid() != launcher_pid:
            on_parent_death()
            os._exit(1)

    return handle


def run_process(
    name: str,
    config: AerieConfig,
    build: Callable[[AerieConfig], Any],
    loop: Callable[[Any], None],
    ready_info: Callable[[Any], dict] | None = None,
    on_parent_death: Callable[[], None] | None = None,
) -> None:
    """Build the core with `build(config)`, report ready, then `loop(core)` until Shutdown.

    The core's `progress` attribute (a `Progress`) is what this process's heartbeats report.
    on_parent_death: cleanup to run if the launcher dies without stopping its children (e.g.
    SIGKILL); this child then gets SIGTERM instead of SIGKILL, runs it and exits. Only a child
    that never blocks in long native calls should take this role."""
    launcher_pid = os.getppid()
    die_with_parent(name, signal.SIGKILL if on_parent_death is None else signal.SIGTERM)
    # The launcher handles SIGINT/SIGTERM for the whole tree and tells children to stop, so a
    # signal sent to the whole process group (Ctrl-C, `timeout`, `kill -- -PGID`) stops the
    # server as one sent to the launcher does; SIGTERM is a child's own business only when it
    # is the death signal of a launcher that is gone.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _orphan_exit(launcher_pid, on_parent_death))
    log = setup_logging(name, config.server.log_level)
    launcher = Sender(endpoints.inbox(config, "launcher"))
    try:
        core = build(config)
        freeze_startup(log)
        info = ready_info(core) if ready_info else {}
        heartbeat = HeartbeatThread(config, name, core.progress)
        heartbeat.start()
        launcher.send(ProcessReady(name=name, pid=os.getpid(), info=info))
        log.debug("ready")
        loop(core)
        heartbeat.stop()
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher
        if isinstance(e, SystemExit) and not e.code:
            return
        error = traceback.format_exc()
        log.error("failed:\n%s", error)
        failure = ProcessFailed(name=name, pid=os.getpid(), error=error)
        report_failure(endpoints.inbox(config, "launcher"), failure)
        sys.stderr.flush()
        os._exit(1)
    log.debug("exited")
