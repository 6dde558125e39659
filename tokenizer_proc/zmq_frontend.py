"""The external ZMQ frontend: a ROUTER socket that serves `aerie.client` (DEALER) peers.

Its wire protocol, its limits and how it notices a client that went away are in
`docs/serving.md`, "The ZMQ protocol". The ROUTER socket has one owner, the asyncio
integration of zmq.asyncio: every receive and every send goes through it (a blocking shadow
of the socket would consume the edge-triggered readiness the asyncio side waits for).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from aerie.access import check_api_key
from tokenizer_proc.client_messages import Envelope, ProtocolError, read_body, read_envelope
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.request_tracker import Chunk, RequestState
from tokenizer_proc.responses import generate_response, interleave, logprob_triples, meta_info
from tokenizer_proc.validation import ValidationError, parse_generate_body
from tokenizer_proc.zmq_limits import ErrorReplyBudget, FrameLog

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
RECV_BATCH = 64  # frames handled between two yields to the event loop
RECV_HWM = 16  # frames queued per connection before libzmq stops reading it (x max bytes)
SEND_HWM = 1024  # replies queued per connection; a client that leaves more unread is dropped
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 15_000
_PING = msgpack.packb({"req_id": None, "event": "ping"})
_BAD_KEY = ValidationError(
    "missing or invalid API key: pass api_key= to the client", "api_key", status=401
)


@dataclass(frozen=True)
class ZmqAccess:
    """api_key: what every generate must carry (None: no key); curve: the server's (public,
    secret) Z85 keys to encrypt with, or None; max_message_bytes: a peer sending a larger
    frame is disconnected by libzmq before the frame is buffered; max_requests_per_connection:
    unfinished generates one connection may have (one more gets a 429 error)."""

    api_key: str | None = None
    curve: tuple[bytes, bytes] | None = None
    max_message_bytes: int = 8 << 20
    max_requests_per_connection: int = 256


class ZmqFrontend:
    """Serves generate/abort ops from many DEALER clients; one task per request."""

    def __init__(
        self,
        frontend: Frontend,
        address: str,
        context: zmq.asyncio.Context | None = None,
        access: ZmqAccess | None = None,
    ) -> None:
        self.frontend = frontend
        self.access = access or ZmqAccess()
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.ROUTER)
        for option, value in (
            (zmq.LINGER, 0),
            (zmq.SNDHWM, SEND_HWM),
            (zmq.RCVHWM, RECV_HWM),
            (zmq.ROUTER_MANDATORY, 1),
            (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
            (zmq.MAXMSGSIZE, self.access.max_message_bytes),
        ):
            self._socket.setsockopt(option, value)
        if self.access.curve is not None:
            self._socket.curve_publickey, self._socket.curve_secretkey = self.access.curve
            self._socket.curve_server = True
        try:
            self._socket.bind(address)
        except zmq.ZMQError as e:
            self._socket.close()
            raise RuntimeError(
                f"cannot bind the ZMQ frontend on {address}: {e} "
                "(is another server using --zmq-port?)"
            ) from e
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: dict[bytes, dict[int | str, asyncio.Task]] = {}
        self._error_budget = ErrorReplyBudget()
        self._frame_log = FrameLog(log)

    async def serve(self) -> None:
        """Receive and dispatch forever, probing clients' liveness (cancel the task to stop)."""
        probe = asyncio.get_running_loop().create_task(self._probe_clients())
        try:
            while True:
                self._handle(await self._socket.recv_multipart())
                for _ in range(RECV_BATCH - 1):
                    try:
                        frames = self._socket.recv_multipart(flags=zmq.NOBLOCK).result()
                    except zmq.Again:
                        break
                    self._handle(frames)
                # NOTE: awaiting a receive that is already done does not yield, so without this
                # a steady stream of frames would keep HTTP and every request from running.
                await asyncio.sleep(0)
        finally:
            probe.cancel()

    def _handle(self, frames: list[bytes]) -> None:
        try:
            self._dispatch(frames)
        except Exception:  # noqa: BLE001 - a bug here must not stop serving everyone
            log.exception("failed to handle a ZMQ client message")

    async def _probe_clients(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for identity in list(self._tasks):
                self._send_raw(identity, _PING)
            self._frame_log.flush_due()

    def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks.values():
                task.cancel()
        self._socket.close(linger=0)

    def _dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            self._refuse(
                identity, None, "malformed frames", ProtocolError("send one frame per message")
            )
            return
        try:
            envelope = read_envelope(frames[1])
        except ProtocolError as e:
            self._refuse(identity, e.req_id, "malformed frames", e)
            return
        if envelope.op == "abort":
            self._on_abort(identity, envelope.req_id)
        else:
            self._on_generate(identity, frames[1], envelope)

    def _on_generate(self, identity: bytes, payload: bytes, envelope: Envelope) -> None:
        """Start a request; the key and the connection's budget are checked before the body is
        read."""
        req_id = envelope.req_id
        if not check_api_key(self.access.api_key, envelope.api_key):
            self._refuse(identity, req_id, "unauthenticated frames", _BAD_KEY)
            return
        tasks = self._tasks.get(identity, {})
        limit = self.access.max_requests_per_connection
        if len(tasks) >= limit:
            error = ValidationError(
                f"this connection already has {limit} requests unfinished (the most "
                "--max-zmq-requests-per-connection allows): wait for replies before sending "
                "more",
                status=429,
            )
            self._refuse(identity, req_id, "frames over their connection's request budget", error)
            return
        if req_id in tasks:
            error = ValidationError("req_id already in use", "req_id")
            self._refuse(identity, req_id, "malformed frames", error)
            return
        try:
            body = read_body(payload, envelope)
        except ProtocolError as e:
            self._refuse(identity, req_id, "malformed frames", e)
            return
        task = asyncio.get_running_loop().create_task(self._run_generate(identity, req_id, body))
        self._tasks.setdefault(identity, tasks)[req_id] = task
        task.add_done_callback(lambda done: self._forget(identity, req_id, done))

    def _on_abort(self, identity: bytes, req_id: int | str) -> None:
        task = self._tasks.get(identity, {}).get(req_id)
        if task is not None:
            task.cancel()

    def _refuse(
        self, identity: bytes, req_id: Any, kind: str, error: ValidationError | ProtocolError
    ) -> None:
        """Answer a frame that starts nothing with an error while its connection's error reply
        budget lasts, else drop it; either way the warning goes through the rate-limited log."""
        answered = self._error_budget.take(identity)
        self._frame_log.warn(kind, f"refused a ZMQ client frame: {error.message}", answered)
        if answered:
            self._send_error(identity, req_id, error)

    def _on_disconnect(self, identity: bytes) -> None:
        self._error_budget.forget(identity)
        tasks = self._tasks.pop(identity, {})
        if tasks:
            log.info("ZMQ client went away; aborting %d request(s)", len(tasks))
        for task in tasks.values():
            task.cancel()

    def _on_stalled(self, identity: bytes) -> None:
        """The client has SEND_HWM replies unread: abort its requests (this reply is dropped)."""
        tasks = self._tasks.pop(identity, {})
        if tasks:
            self._frame_log.warn(
                "clients with their replies unread",
                f"a ZMQ client left {SEND_HWM} replies unread; aborting its {len(tasks)} "
                "request(s) and dropping their replies",
            )
        for task in tasks.values():
            task.cancel()

    def _forget(self, identity: bytes, req_id: int | str, task: asyncio.Task) -> None:
        tasks = self._tasks.get(identity)
        # NOTE: a request aborted with its connection may end after the client has reused its
        # req_id for a new one, which must stay tracked.
        if tasks is not None and tasks.get(req_id) is task:
            del tasks[req_id]
            if not tasks:
                del self._tasks[identity]

    async def _run_generate(self, identity: bytes, req_id: int | str, body: Any) -> None:
        fe = self.frontend
        try:
            gen = parse_generate_body(body, fe.limits.max_batch_size)
            fe.check_accepting(len(gen.items))
            prepared = await fe.prepare_generate(gen, scope=identity)
            states = await fe.submit(prepared, gen.stream, gen.return_logprob)
        except ValidationError as e:
            self._send_error(identity, req_id, e)
            return
        except Exception:  # noqa: BLE001 - answer the request, keep serving
            log.exception("failed to start ZMQ request %r", req_id)
            self._send_error(identity, req_id, ValidationError("internal error", status=500))
            return
        try:
            if gen.stream:
                async for index, chunk in interleave(states):
                    delta = delta_dict(states[index], chunk, gen.return_logprob)
                    if gen.is_batch:
                        delta["index"] = index
                    self._send(identity, req_id, "delta", delta)
            else:
                await asyncio.gather(*(s.wait_finished() for s in states))
            out = [generate_response(s, gen.return_logprob) for s in states]
            self._send(identity, req_id, "done", out if gen.is_batch else out[0])
        except Exception:  # noqa: BLE001 - answer the request, keep serving
            log.exception("failed while serving ZMQ request %r", req_id)
            self._send_error(identity, req_id, ValidationError("internal error", status=500))
        finally:
            fe.abort_unfinished(states)

    def _send(self, identity: bytes, req_id: Any, event: str, data: Any) -> None:
        reply = msgpack.packb({"req_id": req_id, "event": event, "data": data}, use_bin_type=True)
        self._send_raw(identity, reply)

    def _send_raw(self, identity: bytes, payload: bytes) -> None:
        # NOTE: every send is NOBLOCK, so none ever waits in zmq.asyncio's queue and the future
        # is already done: a peer that went away fails it with EHOSTUNREACH, a peer with
        # SEND_HWM replies unread with EAGAIN (ROUTER_MANDATORY reports both).
        sent = self._socket.send_multipart([identity, payload], flags=zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            self._on_stalled(identity)
        elif isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self._on_disconnect(identity)
        elif error is not None:
            log.warning("could not send to a ZMQ client: %s", error)

    def _send_error(
        self, identity: bytes, req_id: int | str | None, e: ValidationError | ProtocolError
    ) -> None:
        status = getattr(e, "status", 400)
        data = {"message": e.message, "param": e.param, "code": status}
        self._send(identity, req_id, "error", data)


def delta_dict(state: RequestState, chunk: Chunk, return_logprob: bool) -> dict[str, Any]:
    """An incremental stream event: the chunk's text/ids with the request's meta at that time."""
    meta = meta_info(state, return_logprob=False, chunk=chunk)
    if return_logprob:
        meta["output_token_logprobs"] = logprob_triples(chunk.logprobs, chunk.output_ids)
    return {"text": chunk.text, "output_ids": list(chunk.output_ids), "meta_info": meta}
