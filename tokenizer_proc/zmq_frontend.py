"""The external ZMQ frontend: a ROUTER socket that serves `aerie.client` (DEALER) peers.

Wire protocol (plain msgpack maps, never pickle; one frame per message on the DEALER side):

    client -> server  {"op": "generate", "req_id": <int|str>, "body": <a /generate body>,
                       "api_key": <str, when the server has a key>}
                      {"op": "abort", "req_id": <int|str>}
    server -> client  {"req_id": ..., "event": "delta", "data": <delta dict>}   (stream only)
                      {"req_id": ..., "event": "done",  "data": <the /generate response>}
                      {"req_id": ..., "event": "error", "data": {"message", "param", "code"}}
                      {"req_id": None, "event": "ping"}   (liveness probe; clients ignore it)

A delta dict is INCREMENTAL: `text` / `output_ids` (and `meta_info.output_token_logprobs` with
return_logprob) hold only what is new; `meta_info` is otherwise current, and the last delta's
`meta_info.finish_reason` is set. A batch body adds `"index"` to each delta. `done` carries
the same dict (or list, for a batch) as POST /generate. `code` is an HTTP-like status
(400 bad request, 401 missing or wrong api_key, 503 draining / not ready / overloaded).
With --zmq-curve the socket is a CURVE server (clients pass its public key); frames larger
than --max-request-bytes make libzmq drop the connection before buffering them.

req_ids are scoped per client connection, and so are the `rid`s a client puts in bodies (the
engine keys requests on ids of its own). Every frame is checked field by field before use
(`client_messages`); anything malformed gets an error reply (req_id None when none could be
read) and one log line, and nothing a client sends can end the receive loop.

The ROUTER socket has one owner, the asyncio integration of zmq.asyncio: every receive and
every send goes through it. (Sending through a blocking shadow of the same socket consumes the
edge-triggered readiness notification the asyncio side waits for, so messages could sit unread
until another peer sent something.)

A client that disconnects has all its requests aborted. Detection: the ROUTER is
ROUTER_MANDATORY, so a send to a peer whose connection is gone fails with EHOSTUNREACH; every
`PROBE_INTERVAL_S` each client with requests in flight is sent a ping, so a silent
non-streaming request is noticed too. ZMTP heartbeats close connections to peers that vanished
without closing TCP. (ROUTER_NOTIFY would be neater but is
a libzmq draft API, absent from the pyzmq wheels.)
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
from tokenizer_proc.client_messages import ClientMessage, ProtocolError, parse_client_message
from tokenizer_proc.frontend import Frontend
from tokenizer_proc.request_tracker import Chunk, RequestState
from tokenizer_proc.responses import generate_response, interleave, logprob_triples, meta_info
from tokenizer_proc.validation import ValidationError, parse_generate_body

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 0.5
HEARTBEAT_IVL_MS = 5_000
HEARTBEAT_TIMEOUT_MS = 15_000
_PING = msgpack.packb({"req_id": None, "event": "ping"})


@dataclass(frozen=True)
class ZmqAccess:
    """api_key: what every generate must carry (None: no key); curve: the server's (public,
    secret) Z85 keys to encrypt with, or None; max_message_bytes: a peer sending a larger
    frame is disconnected by libzmq before the frame is buffered."""

    api_key: str | None = None
    curve: tuple[bytes, bytes] | None = None
    max_message_bytes: int = 8 << 20


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
            (zmq.SNDHWM, 0),
            (zmq.RCVHWM, 0),
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
            raise RuntimeError(f"cannot bind the ZMQ frontend on {address}: {e} "
                               "(is another server using --zmq-port?)") from e  # fmt: skip
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks: dict[bytes, dict[int | str, asyncio.Task]] = {}
        self._ops = {"generate": self._on_generate, "abort": self._on_abort}

    async def serve(self) -> None:
        """Receive and dispatch forever, probing clients' liveness (cancel the task to stop)."""
        probe = asyncio.get_running_loop().create_task(self._probe_clients())
        try:
            while True:
                frames = await self._socket.recv_multipart()
                try:
                    self._dispatch(frames)
                except Exception:  # noqa: BLE001 - a bug here must not stop serving everyone
                    log.exception("failed to handle a ZMQ client message")
        finally:
            probe.cancel()

    async def _probe_clients(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            for identity in list(self._tasks):
                self._send_raw(identity, _PING)

    def close(self) -> None:
        for tasks in self._tasks.values():
            for task in tasks.values():
                task.cancel()
        self._socket.close(linger=0)

    def _dispatch(self, frames: list[bytes]) -> None:
        identity = frames[0]
        if len(frames) != 2:
            log.warning("dropped a ZMQ message of %d frames (clients send one)", len(frames) - 1)
            self._send_error(identity, None, ProtocolError("send one frame per message"))
            return
        try:
            msg = parse_client_message(frames[1])
        except ProtocolError as e:
            log.warning("bad ZMQ client message: %s", e.message)
            self._send_error(identity, e.req_id, e)
            return
        self._ops[msg.op](identity, msg)

    def _on_generate(self, identity: bytes, msg: ClientMessage) -> None:
        if not check_api_key(self.access.api_key, msg.api_key):
            error = ValidationError("missing or invalid API key: pass api_key= to the client",
                                    "api_key", status=401)  # fmt: skip
            self._send_error(identity, msg.req_id, error)
            return
        tasks = self._tasks.setdefault(identity, {})
        if msg.req_id in tasks:
            error = ValidationError("req_id already in use", "req_id")
            self._send_error(identity, msg.req_id, error)
            return
        task = asyncio.get_running_loop().create_task(
            self._run_generate(identity, msg.req_id, msg.body)
        )
        tasks[msg.req_id] = task
        task.add_done_callback(lambda _: self._forget(identity, msg.req_id))

    def _on_abort(self, identity: bytes, msg: ClientMessage) -> None:
        task = self._tasks.get(identity, {}).get(msg.req_id)
        if task is not None:
            task.cancel()

    def _on_disconnect(self, identity: bytes) -> None:
        tasks = self._tasks.pop(identity, {})
        if tasks:
            log.info("ZMQ client went away; aborting %d request(s)", len(tasks))
        for task in tasks.values():
            task.cancel()

    def _forget(self, identity: bytes, req_id: int | str) -> None:
        tasks = self._tasks.get(identity)
        if tasks is not None:
            tasks.pop(req_id, None)
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
        # NOTE: with SNDHWM=0 a ROUTER send never blocks, so the future is already done; an
        # unknown peer (a client that went away) fails it with EHOSTUNREACH.
        sent = self._socket.send_multipart([identity, payload], flags=zmq.NOBLOCK)
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
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
