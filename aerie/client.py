"""The public ZMQ client: `Client` (blocking) and `AsyncClient` (asyncio) over a DEALER socket.

    with Client("tcp://127.0.0.1:30001") as client:
        out = client.generate(text="Hello", sampling_params={"max_new_tokens": 16})

`api_key=` serves --api-key, `server_public_key=` --zmq-curve. One client is one connection,
not thread-safe; the protocol and its limits: `docs/serving.md`, "The ZMQ protocol".
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio


class AerieClientError(RuntimeError):
    """The server refused or failed a request. code: HTTP-like status (400, 503, ...)."""

    def __init__(self, message: str, code: int | None = None, param: str | None = None) -> None:
        super().__init__(message if code is None else f"[{code}] {message}")
        self.message = message
        self.code = code
        self.param = param


class AerieTimeoutError(AerieClientError):
    """No answer within the timeout; the request was aborted on the server."""


def _body(
    text: str | list[str] | None,
    input_ids: list[int] | list[list[int]] | None,
    sampling_params: dict[str, Any] | None,
    return_logprob: bool,
    rid: str | list[str] | None,
    stream: bool,
) -> dict[str, Any]:
    if (text is None) == (input_ids is None):
        raise ValueError("pass exactly one of text or input_ids")
    body: dict[str, Any] = {"stream": stream, "return_logprob": return_logprob}
    body["text" if text is not None else "input_ids"] = text if text is not None else input_ids
    if sampling_params is not None:
        body["sampling_params"] = sampling_params
    if rid is not None:
        body["rid"] = rid
    return body


def _pack(
    op: str, req_id: int, body: dict[str, Any] | None = None, api_key: str | None = None
) -> bytes:
    msg: dict[str, Any] = {"op": op, "req_id": req_id}
    if body is not None:
        msg["body"] = body
    if api_key is not None:
        msg["api_key"] = api_key
    return msgpack.packb(msg, use_bin_type=True)


def _raise_error(data: dict[str, Any]) -> None:
    raise AerieClientError(str(data.get("message")), data.get("code"), data.get("param"))


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _new_socket(
    context: zmq.Context, address: str, server_public_key: bytes | str | None
) -> tuple[zmq.Socket, zmq.Socket]:
    """(DEALER connected to address, a monitor socket reporting failed handshakes)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    if server_public_key is not None:
        public, secret = zmq.curve_keypair()  # this client's own, for this connection
        socket.curve_serverkey = (
            server_public_key.encode() if isinstance(server_public_key, str) else server_public_key
        )
        socket.curve_publickey, socket.curve_secretkey = public, secret
    monitor = socket.get_monitor_socket(_HANDSHAKE_FAILED)
    socket.connect(address)
    return socket, monitor


def _handshake_error(address: str) -> AerieClientError:
    return AerieClientError(
        f"the ZMQ handshake with {address} failed: the server encrypts with CURVE and this "
        "client has no or the wrong server_public_key (or the client has one and the server "
        "does not encrypt)"
    )


class _Closed:
    """An awaitable that is already done (so `AsyncClient.close()` works with or without await)."""

    def __await__(self) -> Iterator[None]:
        return iter(())


class Client:
    """Blocking client. address: the server's ZMQ frontend, e.g. "tcp://127.0.0.1:30001"."""

    def __init__(
        self,
        address: str,
        context: zmq.Context | None = None,
        api_key: str | None = None,
        server_public_key: bytes | str | None = None,
    ) -> None:
        self.address = address
        self.api_key = api_key
        self._socket, self._monitor = _new_socket(
            context or zmq.Context.instance(), address, server_public_key
        )
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._req_ids = itertools.count()

    def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """The /generate response dict (a list of them for a batch prompt)."""
        body = _body(text, input_ids, sampling_params, return_logprob, rid, stream=False)
        req_id = self._start(body)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            event, data = self._recv(req_id, deadline)
            if event == "done":
                return data

    def stream(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Incremental delta dicts until the request finishes; closing early aborts it."""
        body = _body(text, input_ids, sampling_params, return_logprob, rid, stream=True)
        req_id = self._start(body)
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while True:
                event, data = self._recv(req_id, deadline)
                if event == "done":
                    finished = True
                    return
                yield data
        finally:
            if not finished and not self._socket.closed:
                self._socket.send(_pack("abort", req_id))

    def close(self) -> None:
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self, body: dict[str, Any]) -> int:
        req_id = next(self._req_ids)
        self._socket.send(_pack("generate", req_id, body, self.api_key))
        return req_id

    def _recv(self, req_id: int, deadline: float | None) -> tuple[str, Any]:
        """The next reply for req_id (replies to abandoned requests are dropped)."""
        while True:
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1e3))
            ready = dict(self._poller.poll(wait_ms))
            if self._monitor in ready:
                self._monitor.recv_multipart()
                raise _handshake_error(self.address)
            if self._socket not in ready:
                self._socket.send(_pack("abort", req_id))
                raise AerieTimeoutError(f"no answer from {self.address} in time")
            reply = msgpack.unpackb(self._socket.recv(), raw=False)
            if reply.get("req_id") not in (req_id, None) or reply.get("event") == "ping":
                continue
            if reply["event"] == "error":
                _raise_error(reply["data"])
            return reply["event"], reply["data"]


class AsyncClient:
    """asyncio client with the same methods as `Client`, as coroutines / async iterators.

    One background task reads replies and routes them to per-request queues; many requests
    may be in flight at once from one AsyncClient.
    """

    def __init__(
        self,
        address: str,
        context: zmq.asyncio.Context | None = None,
        api_key: str | None = None,
        server_public_key: bytes | str | None = None,
    ) -> None:
        self.address = address
        self.api_key = api_key
        self._socket, self._monitor = _new_socket(
            context or zmq.asyncio.Context.instance(), address, server_public_key
        )
        self._req_ids = itertools.count()
        self._queues: dict[int, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._failed: AerieClientError | None = None

    async def generate(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        body = _body(text, input_ids, sampling_params, return_logprob, rid, stream=False)
        req_id, queue = await self._start(body)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                event, data = await self._next(req_id, queue, deadline)
                if event == "done":
                    return data
        finally:
            self._queues.pop(req_id, None)

    async def stream(
        self,
        text: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        sampling_params: dict[str, Any] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        body = _body(text, input_ids, sampling_params, return_logprob, rid, stream=True)
        req_id, queue = await self._start(body)
        deadline = None if timeout is None else time.monotonic() + timeout
        finished = False
        try:
            while True:
                event, data = await self._next(req_id, queue, deadline)
                if event == "done":
                    finished = True
                    return
                yield data
        finally:
            self._queues.pop(req_id, None)
            if not finished and not self._socket.closed:
                await self._socket.send(_pack("abort", req_id))

    def close(self) -> _Closed:
        """Close now; the result may be awaited (`await client.close()`) or ignored."""
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        return _Closed()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _start(self, body: dict[str, Any]) -> tuple[int, asyncio.Queue]:
        if self._failed is not None:
            raise self._failed
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read())
        if self._watcher is None or self._watcher.done():
            self._watcher = loop.create_task(self._watch_handshake())
        req_id = next(self._req_ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[req_id] = queue
        await self._socket.send(_pack("generate", req_id, body, self.api_key))
        return req_id, queue

    async def _watch_handshake(self) -> None:
        """A failed handshake fails every waiting and future request (no silent hang)."""
        await self._monitor.recv_multipart()
        self._failed = _handshake_error(self.address)
        error = {"event": "error", "data": {"message": self._failed.message, "code": None}}
        for queue in self._queues.values():
            queue.put_nowait(error)

    async def _next(
        self, req_id: int, queue: asyncio.Queue, deadline: float | None
    ) -> tuple[str, Any]:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            reply = await asyncio.wait_for(queue.get(), timeout)
        except asyncio.TimeoutError:
            await self._socket.send(_pack("abort", req_id))
            raise AerieTimeoutError(f"no answer from {self.address} in time") from None
        if reply["event"] == "error":
            _raise_error(reply["data"])
        return reply["event"], reply["data"]

    async def _read(self) -> None:
        while True:
            reply = msgpack.unpackb(await self._socket.recv(), raw=False)
            queue = self._queues.get(reply.get("req_id"))
            if queue is not None:
                queue.put_nowait(reply)
            elif reply.get("req_id") is None and reply.get("event") == "error":
                for q in self._queues.values():
                    q.put_nowait(reply)
