"""`run_tokenizer_process`: wire a frontend to its sockets and run everything on one uvloop.

Everything is bound before ProcessReady, so a taken port fails the launch clearly; uvicorn,
the ZMQ frontend (the first frontend only) and the inbox reader then run as tasks of one asyncio
loop, the inbox dispatching by message type through a table. With several frontends
(`--tokenizer-worker-num`) each binds the HTTP port with SO_REUSEPORT, and the kernel spreads
new connections over them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import uvicorn
import uvloop

from aerie import endpoints
from aerie.access import load_curve_keypair
from aerie.config import AerieConfig
from aerie.messages import (
    AbortRequest,
    BeginDrain,
    DebugQuery,
    DebugReport,
    DrainDone,
    EngineReady,
    FrontendMetrics,
    FrontendReady,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    TokenizedRequest,
)
from aerie.process import Progress, run_process
from aerie.transport import AsyncReceiver, AsyncSender
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http_api import create_app
from tokenizer_proc.http_guard import GuardPolicy, edge_protocol
from tokenizer_proc.request_tracker import SERVER_STOPPING
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import Limits
from tokenizer_proc.zmq_frontend import ZmqAccess, ZmqFrontend

log = logging.getLogger(__name__)

UVICORN_GRACEFUL_S = 3.0
HTTP_BACKLOG = 2048  # connections the kernel queues for accept
DEBUG_QUERY_TIMEOUT_S = 5.0  # a scheduler that does not answer a DebugQuery in time is stuck
TICK_S = 1.0  # a heartbeat task restarts the loop's unit this often: a blocked loop stands still
SHARE_METRICS_S = 1.0  # how often a frontend sends its request counts to the others


class SchedulerBackend:
    """The Frontend's backend in the real process: the schedulers' inboxes, one per
    data-parallel replica. A new request goes to the replica with the fewest unfinished
    requests sent to it (the first such replica on a tie); its abort follows it there."""

    def __init__(self, senders: list[AsyncSender], frontend: int = 0) -> None:
        """frontend: the index of the frontend this backend serves (DebugReports come back to
        it)."""
        self._senders = senders
        self._frontend = frontend
        self._replica_of: dict[str, int] = {}  # rid -> replica, while unfinished
        self.load = [0] * len(senders)  # unfinished requests per replica
        self._query_ids = itertools.count()
        self._queries: dict[int, list[asyncio.Future[DebugReport]]] = {}  # one per replica

    async def submit(self, request: TokenizedRequest) -> None:
        replica = min(range(len(self._senders)), key=self.load.__getitem__)
        self._replica_of[request.rid] = replica
        self.load[replica] += 1
        await self._senders[replica].send(request)

    def abort(self, rid: str) -> Coroutine[Any, Any, None]:
        replica = self._replica_of.get(rid, 0)
        return self._senders[replica].send(AbortRequest(rid))

    def finished(self, rid: str) -> None:
        replica = self._replica_of.pop(rid, None)
        if replica is not None:
            self.load[replica] -= 1

    async def describe(self, flush_cache: bool = False) -> list[dict[str, Any]]:
        """Each replica's scheduler state and requests (`Scheduler.describe`), or
        `answered: False` for a scheduler that did not answer within DEBUG_QUERY_TIMEOUT_S;
        flush_cache: each scheduler first drops its unused cached prefixes."""
        query_id = next(self._query_ids)
        loop = asyncio.get_running_loop()
        futures = self._queries[query_id] = [loop.create_future() for _ in self._senders]
        try:
            for sender in self._senders:
                await sender.send(DebugQuery(query_id, flush_cache, self._frontend))
            await asyncio.wait(futures, timeout=DEBUG_QUERY_TIMEOUT_S)
        finally:
            del self._queries[query_id]
        described = []
        for replica, future in enumerate(futures):
            if not future.done():
                described.append({"replica": replica, "answered": False})
                continue
            report = future.result()
            summary = {"replica": replica, "answered": True, **report.summary}
            described.append({**summary, "requests": report.requests})
        return described

    def on_debug_report(self, report: DebugReport) -> None:
        futures = self._queries.get(report.query_id)  # None: its query timed out
        if futures is not None and not futures[report.replica].done():
            futures[report.replica].set_result(report)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the launcher decides when we stop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def frontend_limits(config: AerieConfig, tokenizer: Tokenizer) -> Limits:
    """What one frontend accepts; the requests in flight are shared out evenly among the
    frontends."""
    assert config.model.context_length is not None
    rows = (config.scheduler.max_running_requests or 0) * config.parallel.dp_size
    frontends = max(1, config.server.tokenizer_worker_num)
    return Limits(
        vocab_size=tokenizer.vocab_size,
        context_length=config.model.context_length,
        max_batch_size=config.limits.max_batch_size,
        max_in_flight=-(-(rows + config.limits.max_queued_requests) // frontends),
        max_token_bytes=tokenizer.max_token_bytes,
    )


def frontend_connections(config: AerieConfig) -> int | None:
    """The HTTP connections one frontend serves at once: --max-connections shared out evenly
    among the frontends (the kernel spreads connections over them, so the server as a whole
    may hold up to one more per frontend)."""
    cap = config.limits.max_connections
    return None if cap is None else -(-cap // max(1, config.server.tokenizer_worker_num))


def zmq_access(config: AerieConfig) -> ZmqAccess:
    security = config.security
    curve = None
    if security.zmq_curve and security.zmq_curve_key_file:
        public, secret = load_curve_keypair(security.zmq_curve_key_file)
        curve = (public, secret)
        log.info(
            "ZMQ port encrypted with CURVE; server public key %s (from %s)",
            public.decode(),
            security.zmq_curve_key_file,
        )
    limits = config.limits
    return ZmqAccess(
        security.api_key, curve, limits.max_request_bytes, limits.max_zmq_requests_per_connection
    )


class TokenizerProcess:
    """Owns the sockets and the loop's tasks; `run()` returns after Shutdown."""

    def __init__(self, config: AerieConfig, index: int = 0, open_flag: Any = None) -> None:
        """index: this frontend's among `--tokenizer-worker-num`; open_flag: the launcher's
        (`Frontend`)."""
        self.config, self.index = config, index
        model = config.model
        if not (
            model.model_path
            and model.tokenizer_path
            and model.context_length
            and config.server.served_model_name
        ):
            raise ValueError("the config is not resolved: use aerie.resolve.resolve_config first")
        tokenizer = Tokenizer.from_config(config)
        self.schedulers = [
            AsyncSender(endpoints.inbox(config, endpoints.scheduler_name(replica)))
            for replica in range(config.parallel.dp_size)
        ]
        self.launcher = AsyncSender(endpoints.inbox(config, "launcher"))
        self.peers = [
            AsyncSender(endpoints.inbox(config, name))
            for name in endpoints.frontend_names(config)
            if name != endpoints.frontend_name(index)
        ]
        self.backend = SchedulerBackend(self.schedulers, index)
        self.frontend = Frontend(
            tokenizer,
            frontend_limits(config, tokenizer),
            self.backend,
            config.server.served_model_name,  # resolved: the model directory's name by default
            config.model.random_seed,
            index,
            open_flag,
        )
        shared = config.server.tokenizer_worker_num > 1
        self.http_socket = endpoints.http_socket(
            config.server.host, config.server.port, shared, HTTP_BACKLOG
        )
        self.zmq = None
        if index == 0:
            address = endpoints.client_bind_address(config)
            self.zmq = ZmqFrontend(self.frontend, address, access=zmq_access(config))
        self.inbox = AsyncReceiver(endpoints.inbox(config, endpoints.frontend_name(index)))
        security, limits = config.security, config.limits
        policy = GuardPolicy(
            security.api_key,
            security.allowed_hosts,
            limits.max_request_bytes,
            limits.body_timeout_s,
        )
        uv_config = uvicorn.Config(
            create_app(self.frontend, policy),
            log_config=None,
            log_level=config.server.log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=UVICORN_GRACEFUL_S,
            http=edge_protocol(
                limits.header_timeout_s,
                frontend_connections(config),
                limits.slow_client_timeout_s,
            ),
        )
        self.server = _Server(uv_config)
        self._stop = asyncio.Event()
        self._background: set[asyncio.Task] = set()
        self.handlers: dict[type, Callable[[Any], None]] = {
            StepOutputs: self.frontend.tracker.feed,
            SchedulerStats: self.frontend.metrics.observe_stats,
            FrontendMetrics: self.frontend.metrics.observe_peer,
            DebugReport: self.backend.on_debug_report,
            EngineReady: self.on_engine_ready,
            BeginDrain: self.on_begin_drain,
            Shutdown: self.on_shutdown,
        }
        self.progress = Progress()

    def ready_info(self) -> dict[str, int | float | str]:
        host, port = self.http_socket.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        info = {"http_url": f"http://{host}:{port}"}
        return info if self.zmq is None else {**info, "zmq_address": self.zmq.address}

    async def run(self) -> None:
        http = asyncio.create_task(self.server.serve(sockets=[self.http_socket]))
        others = [asyncio.create_task(self.read_inbox()), asyncio.create_task(self.tick())]
        if self.peers:
            others.append(asyncio.create_task(self.share_metrics()))
        if self.zmq is not None:
            others.append(asyncio.create_task(self.zmq.serve()))
        stop = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([http, stop, *others], return_when=asyncio.FIRST_COMPLETED)
        self.server.should_exit = True
        await http
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        for task in done:
            if task is not stop and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if stop not in done:
            raise RuntimeError("the HTTP server stopped before Shutdown")
        self.close()

    async def tick(self) -> None:
        # Well inside the watchdog's bound, so a healthy loop never looks stalled.
        interval_s = min(TICK_S, self.config.server.watchdog_timeout_s / 4)
        while True:
            self.progress.begin("its event loop")
            await asyncio.sleep(interval_s)

    async def share_metrics(self) -> None:
        """Send this frontend's request counts to the other frontends when they changed."""
        last: FrontendMetrics | None = None
        while True:
            await asyncio.sleep(SHARE_METRICS_S)
            message = self.frontend.metrics.snapshot(self.index)
            if message != last:
                for peer in self.peers:
                    await peer.send(message)
                last = message

    async def read_inbox(self) -> None:
        while True:
            message = await self.inbox.recv()
            handler = self.handlers.get(type(message))
            if handler is None:
                raise TypeError(f"a frontend cannot handle {type(message).__name__}")
            handler(message)

    def on_engine_ready(self, message: EngineReady) -> None:
        self.frontend.mark_ready(message.server_info, message.pids)
        log.info("engine ready")
        self.in_background(self.launcher.send(FrontendReady(endpoints.frontend_name(self.index))))

    def on_begin_drain(self, message: BeginDrain) -> None:
        self.frontend.begin_drain()
        self.in_background(self.drain(message.timeout_s))

    def in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run work as a task of the loop, held until it is done (the handlers are not async)."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def drain(self, timeout_s: float) -> None:
        """Wait for in-flight requests; report DrainDone; abort what did not finish."""
        tracker = self.frontend.tracker
        await tracker.wait_idle(timeout_s)
        num_unfinished = tracker.num_in_flight
        self.abort_in_flight()
        log.info("drained (%d unfinished)", num_unfinished)
        await self.launcher.send(DrainDone(num_unfinished=num_unfinished))

    def on_shutdown(self, message: Shutdown) -> None:
        log.info("shutting down%s", f": {message.reason}" if message.reason else "")
        self.frontend.begin_drain()
        self.abort_in_flight()  # answered now, not cancelled at uvicorn's graceful timeout
        self._stop.set()

    def abort_in_flight(self) -> None:
        """End every request in flight as stopped by the server (HTTP clients get a 503)."""
        for rid in self.frontend.tracker.rids():
            self.frontend.abort(rid, SERVER_STOPPING)

    def close(self) -> None:
        if self.zmq is not None:
            self.zmq.close()
        self.inbox.close()
        for sender in (*self.schedulers, *self.peers):
            sender.close()
        self.launcher.close()
        self.http_socket.close()


def run_tokenizer_process(config: AerieConfig, index: int = 0, open_flag: Any = None) -> None:
    """Entry point of frontend process `index` (see module docstring)."""
    run_process(
        endpoints.frontend_name(index),
        config,
        lambda config: TokenizerProcess(config, index, open_flag),
        lambda proc: uvloop.run(proc.run()),
        ready_info=lambda proc: proc.ready_info(),
        # The launcher removes the runtime directory of IPC sockets when it exits; if it is
        # killed outright, this process (woken by SIGTERM) does.
        on_parent_death=lambda: shutil.rmtree(config.runtime_dir, ignore_errors=True),
    )
