"""Start an Aerie server: spawn its processes, wait until they are ready, supervise, drain.

    python launch.py [--model-path DIR] [--port 30000] ...     (python launch.py --help)

Start order: the GPU worker first (it loads weights and measures how much KV fits; with
--tp-size N, one worker process per tensor-parallel rank), then the scheduler and the frontends
(--tokenizer-worker-num, sharing the HTTP port) with the worker's KV capacity filled into the
config.
If any child fails, dies or is stuck (`Watchdog`), every child is stopped and the launcher
exits non-zero. SIGTERM or SIGINT (to the launcher or its whole process group) drains: the
frontends answer new requests with 503, running requests finish (bounded by
--drain-timeout-s), then children stop in order. Under systemd
(Type=notify) it reports READY=1 and STOPPING=1 through $NOTIFY_SOCKET.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from aerie import endpoints
from aerie.config import AerieConfig, config_from_args
from aerie.logging import setup_logging
from aerie.messages import (
    BeginDrain,
    DrainDone,
    EngineReady,
    FrontendReady,
    Heartbeat,
    HeartbeatAck,
    ProcessFailed,
    ProcessReady,
    Shutdown,
)
from aerie.model_info import ModelDirError
from aerie.resolve import ConfigError, resolve_config
from aerie.transport import Receiver, Sender
from aerie.watchdog import Watchdog

log = logging.getLogger("launcher")

STOP_TIMEOUT_S = 5.0
_POLL_S = 0.2


class LaunchError(RuntimeError):
    """A child failed to start or died; the message names it."""


def _entry_point(name: str) -> Callable[..., None]:
    if name.startswith("tokenizer"):  # the frontends: tokenizer, tokenizer1, ...
        from tokenizer_proc.process import run_tokenizer_process

        return run_tokenizer_process
    if name.endswith("scheduler"):  # one per data-parallel replica
        from scheduler_proc.process import run_scheduler_process

        return run_scheduler_process
    # Every replica's ranks (gpu_worker, tp1_worker, dp1_worker...).
    from gpu_worker.process import run_gpu_worker_process

    return run_gpu_worker_process


def sd_notify(state: str) -> None:
    """Tell systemd our state (no-op unless started by systemd with Type=notify)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.sendto(state.encode(), address)


class Launcher:
    def __init__(self, config: AerieConfig) -> None:
        self.config = config
        self.inbox = Receiver(endpoints.inbox(config, "launcher"))
        replicas = range(config.parallel.dp_size)
        # Node 0 serves (frontends, schedulers); with --nnodes the other machines run worker
        # ranks only.
        self.serving = config.parallel.node_rank == 0
        self.ranks = endpoints.node_ranks(config)  # the tensor-parallel ranks of this machine
        # Per data-parallel replica: its scheduler and this machine's worker ranks, in order.
        self.schedulers = [endpoints.scheduler_name(r) for r in replicas] if self.serving else []
        self.replica_workers = [
            tuple(endpoints.worker_name(rank, r) for rank in self.ranks) for r in replicas
        ]
        self.workers = tuple(name for names in self.replica_workers for name in names)
        self.frontends = endpoints.frontend_names(config) if self.serving else ()
        self.stop_order = (*self.frontends, *self.schedulers, *self.workers)
        # One long-lived sender per child inbox: a sender dropped right after send() may lose
        # the message before ZMQ has connected.
        self.to = {name: Sender(endpoints.inbox(config, name)) for name in self.stop_order}
        self.heartbeat_to = {
            name: Sender(endpoints.heartbeat(config, name)) for name in self.stop_order
        }
        self.procs: dict[str, mp.Process] = {}
        self.listening: dict[str, int | float | str] = {}
        self.stop_signal: int | None = None
        self._mp = mp.get_context("spawn")
        # Set once every frontend holds the engine's info; each reads it before answering
        # /health or taking a request (see FrontendReady).
        self.open_flag = self._mp.Value("b", 0, lock=False)

    # ---------------------------------------------------------------------------- start-up

    def spawn(self, name: str, config: AerieConfig, *args: object) -> None:
        proc = self._mp.Process(
            target=_entry_point(name), args=(config, *args), name=f"aerie-{name}"
        )
        proc.start()
        self.procs[name] = proc

    def wait_ready(self, names: tuple[str, ...], kind: type = ProcessReady) -> dict[str, Any]:
        """Block until every named child sent a `kind` message (ProcessReady: it started);
        raise LaunchError otherwise."""
        pending, ready = set(names), {}
        deadline = time.monotonic() + self.config.server.startup_timeout_s
        while pending:
            if self.stop_signal is not None:
                raise LaunchError(f"interrupted while starting ({', '.join(sorted(pending))})")
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"the {', '.join(sorted(pending))} process(es) did not become ready within "
                    f"{self.config.server.startup_timeout_s:.0f} s (--startup-timeout-s)"
                )
            message = self.inbox.recv(timeout_s=_POLL_S)
            if isinstance(message, ProcessFailed):
                raise LaunchError(f"the {message.name} process failed to start:\n{message.error}")
            if isinstance(message, kind) and message.name in pending:
                pending.discard(message.name)
                ready[message.name] = message
            self.raise_if_dead(" to start")
        return ready

    def start(self) -> AerieConfig:
        """Start all children; returns the config with the worker's KV capacity filled in."""
        for replica, names in enumerate(self.replica_workers):
            for rank, name in zip(self.ranks, names, strict=True):
                self.spawn(name, self.config, rank, replica)
        workers_ready = self.wait_ready(self.workers)
        if not self.serving:
            return self.config
        configs = []  # each replica's scheduler plans for its own worker's KV capacity
        for names in self.replica_workers:
            replica_info = workers_ready[names[0]].info
            # Adaptive speculation's step costs, measured by the worker unless given.
            costs = self.config.speculative.speculative_step_costs or replica_info.get(
                "speculative_step_costs"
            )
            configs.append(
                self.config.replace(
                    cache={"max_total_tokens": int(replica_info["max_total_tokens"])},
                    scheduler={"max_running_requests": int(replica_info["max_running_requests"])},
                    speculative={"speculative_step_costs": costs},
                )
            )
        info, config = workers_ready["gpu_worker"].info, configs[0]
        for replica, name in enumerate(self.schedulers):
            self.spawn(name, configs[replica], replica)
        reserved = None
        if len(self.frontends) > 1:  # one port for all of them, port 0 included
            # Held, bound but not listening, while the frontends start and bind it too: the
            # port the OS picks for --port 0 stays ours, and a taken port names itself.
            try:
                reserved = endpoints.http_socket(config.server.host, config.server.port, True)
            except RuntimeError as e:
                raise LaunchError(str(e)) from e
            config = config.replace(server={"port": reserved.getsockname()[1]})
        try:
            for index, name in enumerate(self.frontends):
                self.spawn(name, config, index, self.open_flag)
            ready = self.wait_ready((*self.schedulers, *self.frontends))
        finally:
            if reserved is not None:
                reserved.close()
        self.listening = ready["tokenizer"].info  # the addresses actually bound (port 0)
        server_info = {**public_info(config), **info, **self.listening, "version": "0.1.0"}
        pids = {name: proc.pid for name, proc in self.procs.items() if proc.pid is not None}
        pids["launcher"] = os.getpid()
        for name in self.frontends:
            self.to[name].send(EngineReady(server_info=server_info, pids=pids))
        # Each frontend takes EngineReady in its own time: open them all at once, so that a
        # client that saw /health answer 200 is not refused by a frontend still behind.
        self.wait_ready(self.frontends, FrontendReady)
        self.open_flag.value = 1
        return config

    # ---------------------------------------------------------------------------- supervision

    def raise_if_dead(self, phase: str = "") -> None:
        """Raise LaunchError for a dead child, with its own failure report when it sent one
        (a child reports and then exits, so its death may be seen before the report is read)."""
        for name, proc in self.procs.items():
            if proc.is_alive():
                continue
            # Killed by a signal, a child sent no report; exiting non-zero, it sent one first.
            error = self.failure_report(name) if proc.exitcode and proc.exitcode > 0 else None
            if error is not None:
                raise LaunchError(f"the {name} process failed{phase}:\n{error}")
            raise LaunchError(
                f"the {self.describe(name)} exited unexpectedly (code {proc.exitcode})"
            )

    def failure_report(self, name: str, wait_s: float = 1.0) -> str | None:
        """The error a dead child reported, if it reaches the inbox within wait_s."""
        deadline = time.monotonic() + wait_s
        while (left := deadline - time.monotonic()) > 0:
            message = self.inbox.recv(timeout_s=left)
            if message is None:
                return None
            if isinstance(message, ProcessFailed) and message.name == name:
                return message.error
        return None

    def supervise(self) -> None:
        """Return when a stop signal arrives; raise LaunchError when a child dies, fails or
        is stuck (see `Watchdog`). Under systemd, WATCHDOG=1 goes out only while no child is
        stuck."""
        server = self.config.server
        watchdog = Watchdog(
            tuple(self.procs),
            server.watchdog_timeout_s,
            server.watchdog_busy_timeout_s,
            long_work=self.workers,
        )
        while self.stop_signal is None:
            now = time.monotonic()
            if watchdog.due(now):
                for name in self.procs:
                    self.heartbeat_to[name].send(Heartbeat(watchdog.seq))
            stuck = watchdog.stuck(now)
            if stuck is not None:
                name, why = stuck
                raise LaunchError(
                    f"the {self.describe(name)} {why}; exiting so that the server can be restarted"
                )
            for line in watchdog.reports(now):
                log.info("%s", line)
            if watchdog.notify_due(now):
                sd_notify("WATCHDOG=1")
            message = self.inbox.recv(timeout_s=_POLL_S)
            if isinstance(message, ProcessFailed):
                self.raise_failure(message)
            if isinstance(message, HeartbeatAck):
                watchdog.answered(message, time.monotonic())
            if not self.serving and self.stopped_by_node_zero():
                return
            self.raise_if_dead()

    def describe(self, name: str) -> str:
        """A child as errors name it: "tp1_worker process (tensor-parallel rank 1)"."""
        for replica, names in enumerate(self.replica_workers):
            if name in names and len(self.workers) > 1:
                where = f"rank {self.ranks[names.index(name)]} of replica {replica}"
                return f"{name} process (tensor-parallel {where})"
        return f"{name} process"

    def stopped_by_node_zero(self) -> bool:
        """On a machine other than node 0: a worker that exited cleanly was told to stop by
        rank 0 (node 0 is stopping the server)."""
        if any(proc.exitcode == 0 for proc in self.procs.values()):
            log.info("node 0 stopped the server")
            return True
        return False

    def raise_failure(self, failure: ProcessFailed) -> None:
        """Raise LaunchError for a child's failure report. A tensor-parallel rank fails when a
        peer dies under it (its collective loses the connection): the dead peer is the cause,
        so it is named first."""
        peers = [names for names in self.replica_workers if failure.name in names]
        if peers:
            for name in peers[0]:
                proc = self.procs[name]
                if name != failure.name and not proc.is_alive():
                    raise LaunchError(
                        f"the {self.describe(name)} exited unexpectedly (code {proc.exitcode});"
                        f" the {failure.name} process failed after it:\n{failure.error}"
                    )
        hint = ""
        if peers and self.config.parallel.nnodes > 1:
            hint = " (if a rank on another machine stopped, its node's log says why)"
        raise LaunchError(f"the {failure.name} process failed{hint}:\n{failure.error}")

    def drain(self) -> None:
        """Let running requests finish (bounded), with new requests refused by the frontends."""
        timeout = self.config.server.drain_timeout_s
        log.info("draining: new requests get 503, running requests get up to %.0f s", timeout)
        for name in self.frontends:
            self.to[name].send(BeginDrain(timeout_s=timeout))
        deadline = time.monotonic() + timeout + 5
        waiting, num_unfinished = len(self.frontends), 0
        while waiting and time.monotonic() < deadline:
            message = self.inbox.recv(timeout_s=_POLL_S)
            if isinstance(message, DrainDone):
                waiting -= 1
                num_unfinished += message.num_unfinished
            if any(not p.is_alive() for p in self.procs.values()):
                return
        if num_unfinished:
            log.warning("drain timed out with %d unfinished requests", num_unfinished)

    def stop_children(self, reason: str) -> None:
        """Send Shutdown to every child (the frontends first, so they stop taking requests,
        then the schedulers and workers), give them STOP_TIMEOUT_S together to
        exit, then kill whatever is left (no orphans). They exit in parallel: each takes about
        a second to tear down."""
        alive = {n: p for n, p in self.procs.items() if p.is_alive()}
        for name in self.stop_order:
            if name in alive and not self.forwarded_by_rank_zero(name, alive):
                self.to[name].send(Shutdown(reason=reason))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in alive.values():
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=2)

    def forwarded_by_rank_zero(self, name: str, alive: dict[str, mp.Process]) -> bool:
        """Whether rank 0 of name's replica runs here and will pass Shutdown on: it forwards
        it after the plans it forwarded before, so every rank runs those plans (a Shutdown
        of ours could overtake them and leave rank 0 in a collective with no peer)."""
        for names in self.replica_workers:
            if name in names[1:]:
                return self.ranks.start == 0 and names[0] in alive
        return False

    def on_signal(self, signum: int, _frame: object) -> None:
        """First SIGTERM/SIGINT: drain. A second one: kill every child and exit at once."""
        if self.stop_signal is None:
            self.stop_signal = signum
            return
        log.warning("second signal: stopping now without draining")
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(self.config.runtime_dir, ignore_errors=True)
        os._exit(128 + signum)


# Filesystem paths and internal addresses: /server_info shows them only with
# --enable-debug-info.
PATH_FIELDS = (
    "model_path",
    "tokenizer_path",
    "speculative_draft_model_path",
    "runtime_dir",
    "zmq_curve_key_file",
    "dist_init_addr",
)


def public_info(config: AerieConfig) -> dict:
    """The resolved config as /server_info shows it: secrets never, filesystem paths only with
    --enable-debug-info (the model is named by --served-model-name)."""
    info = config.to_flat_dict()
    if not config.security.enable_debug_info:
        for name in PATH_FIELDS:
            info.pop(name, None)
    return info


def log_ready(launcher: Launcher, served: AerieConfig) -> None:
    parallel = served.parallel
    if not launcher.serving:
        log.info(
            "Aerie node %d of %d is ready: tensor-parallel ranks %d..%d, with node 0 at %s",
            parallel.node_rank,
            parallel.nnodes,
            launcher.ranks[0],
            launcher.ranks[-1],
            parallel.dist_init_addr,
        )
        return
    log.info(
        "Aerie is ready: %s (ZMQ %s), model %s on %s/%s",
        launcher.listening["http_url"],
        launcher.listening["zmq_address"],
        served.model.model_path,
        served.model.device,
        served.model.dtype,
    )
    if parallel.tp_size * parallel.dp_size > 1:
        log.info(
            "%d replica(s) of %d tensor-parallel rank(s) over %d machine(s)",
            parallel.dp_size,
            parallel.tp_size,
            parallel.nnodes,
        )
    spec = served.speculative
    if spec.enabled:
        log.info(
            "speculative decoding: %s, draft %s, S=%s topk=%s ND=%s",
            spec.speculative_algorithm,
            spec.speculative_draft_model_path or "in the model",
            spec.speculative_num_steps,
            spec.speculative_eagle_topk,
            spec.speculative_num_draft_tokens,
        )


def main(argv: list[str] | None = None) -> int:
    try:
        config = resolve_config(config_from_args(argv))
    except (ConfigError, ModelDirError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    setup_logging("launcher", config.server.log_level)
    launcher = Launcher(config)
    signal.signal(signal.SIGTERM, launcher.on_signal)
    signal.signal(signal.SIGINT, launcher.on_signal)
    code = 0
    try:
        log_ready(launcher, launcher.start())
        sd_notify("READY=1")
        launcher.supervise()
        sd_notify("STOPPING=1")
        if launcher.serving:
            launcher.drain()
        launcher.stop_children("signal")
    except LaunchError as e:
        log.error("%s", e)
        code = 1
    finally:
        launcher.stop_children("launcher exiting")
        shutil.rmtree(config.runtime_dir, ignore_errors=True)
    log.info("stopped")
    return code


if __name__ == "__main__":
    sys.exit(main())
