"""Process bootstrap shared by the four `run_<name>_process` entry points.

`run_process` sets up logging with the process tag, ties the child's life to the launcher's
(Linux parent-death signal, so no orphans), builds the process's core, reports
`ProcessReady` to the launcher, runs the loop, and on any exception reports `ProcessFailed`
with the traceback before exiting non-zero.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.logging import setup_logging
from aerie.messages import Heartbeat, HeartbeatAck, ProcessFailed, ProcessReady
from aerie.transport import Sender

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class HeartbeatResponder:
    """The handler every process loop registers for `Heartbeat`: it answers the launcher
    from the loop itself, so a loop that is stuck (or a stopped process) stops answering."""

    def __init__(self, config: AerieConfig, name: str) -> None:
        self.name = name
        self.sender = Sender(endpoints.inbox(config, "launcher"))

    def __call__(self, message: Heartbeat) -> None:
        self.sender.send(HeartbeatAck(self.name, message.seq))


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


def run_process(
    name: str,
    config: AerieConfig,
    build: Callable[[AerieConfig], Any],
    loop: Callable[[Any], None],
    ready_info: Callable[[Any], dict] | None = None,
    on_parent_death: Callable[[], None] | None = None,
) -> None:
    """Build the core with `build(config)`, report ready, then `loop(core)` until Shutdown.

    on_parent_death: cleanup to run if the launcher dies without stopping its children (e.g.
    SIGKILL); this child then gets SIGTERM instead of SIGKILL, runs it and exits. Only a child
    that never blocks in long native calls should take this role."""
    if on_parent_death is None:
        die_with_parent(name)
    else:
        die_with_parent(name, signal.SIGTERM)
        signal.signal(signal.SIGTERM, lambda *_: (on_parent_death(), os._exit(1)))
    # The launcher handles SIGINT/SIGTERM for the whole tree and tells children to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    log = setup_logging(name, config.server.log_level)
    launcher = Sender(endpoints.inbox(config, "launcher"))
    try:
        core = build(config)
        info = ready_info(core) if ready_info else {}
        launcher.send(ProcessReady(name=name, pid=os.getpid(), info=info))
        log.debug("ready")
        loop(core)
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
