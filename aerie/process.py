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

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.logging import setup_logging
from aerie.messages import ProcessFailed, ProcessReady
from aerie.transport import Sender

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(name: str) -> None:
    """Ask Linux to SIGKILL this process when its parent (the launcher) dies, and name it
    `aerie-<name>` (first 15 bytes) so `ps`/`top` show which process is which."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(_PR_SET_NAME, f"aerie-{name}".encode()[:15])
    except OSError:
        pass
    if os.getppid() == 1:  # the parent already died before prctl took effect
        os._exit(1)


def run_process(
    name: str,
    config: AerieConfig,
    build: Callable[[AerieConfig], Any],
    loop: Callable[[Any], None],
    ready_info: Callable[[Any], dict] | None = None,
) -> None:
    """Build the core with `build(config)`, report ready, then `loop(core)` until Shutdown."""
    die_with_parent(name)
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
        launcher.send(ProcessFailed(name=name, pid=os.getpid(), error=error))
        launcher.close()
        sys.stderr.flush()
        os._exit(1)
    log.debug("exited")
