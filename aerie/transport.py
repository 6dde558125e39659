"""Typed messages between processes, encoded by `aerie.codec`: ZMQ inboxes, and the step link.

`Sender` / `Receiver` are ZMQ PUSH/PULL (each process binds one inbox); the async pair serves
the tokenizer process. `StepLink`, the hot path between a scheduler and its worker rank 0, is
one Unix stream socket, length-framed, that the two read and write themselves; `Inbox` reads a
process's ZMQ inbox and its link as one.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Any

import zmq
import zmq.asyncio

from aerie import codec


def _configure(socket: zmq.Socket) -> None:
    # NOTE: a short linger lets a message sent just before close (ProcessFailed, Shutdown)
    # still reach its peer, without ever blocking a process's exit for long.
    socket.setsockopt(zmq.LINGER, 1000)
    # NOTE: internal edges have no high-water mark on purpose: at one, PUSH blocks its sender,
    # and a scheduler blocked on a busy detokenizer (itself blocked on the tokenizer) would
    # stall the engine. What crosses them is bounded before it gets here: requests and their
    # aborts by the tokenizer's admission (--max-queued-requests, per-connection budgets),
    # deltas by the engine's own pace. A client reaches none of them directly.
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)


class Sender:
    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        _configure(self._socket)
        self._socket.connect(address)
        self.address = address

    def send(self, message: Any) -> None:
        self.send_encoded(codec.encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send a message already encoded by `aerie.codec` (one encoding for many peers)."""
        self._socket.send(data, copy=False)

    def close(self) -> None:
        self._socket.close()


class Receiver:
    def __init__(self, address: str, context: zmq.Context | None = None) -> None:
        self._socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        _configure(self._socket)
        self.address = self.bind(address)

    def bind(self, address: str) -> str:
        """Also receive at `address`; returns the address bound (a tcp://host:* address gets
        the port the OS picked)."""
        self._socket.bind(address)
        return self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None if none came within timeout_s (None waits forever)."""
        if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self._socket.recv(copy=True))

    def drain(self) -> list[Any]:
        """Every message available now, without waiting."""
        messages = []
        while (message := self.try_recv()) is not None:
            messages.append(message)
        return messages

    def try_recv(self) -> Any | None:
        """The next message if one is there, else None (never waits)."""
        try:
            return codec.decode(self._socket.recv(flags=zmq.NOBLOCK))
        except zmq.Again:
            return None

    def poll_target(self) -> zmq.Socket:
        """What `Inbox` waits on for this receiver."""
        return self._socket

    def close(self) -> None:
        self._socket.close(linger=0)


class StepLink:
    """One end of the scheduler-worker step link (see the module docstring). `listen` on the
    worker's side (the peer is accepted when it comes), `connect` on the scheduler's; then
    either end sends and receives. A peer that goes away closes the link: nothing more is
    received (the launcher notices the dead process) and a send raises."""

    HEADER = struct.Struct("<I")  # the encoded message's length
    BUFFER_BYTES = 4 << 20  # socket buffers: a long prompt's plan goes over in one write
    READ_BYTES = 1 << 16  # one read's scratch, allocated once (a busy poll reads often)

    def __init__(self, listener: socket.socket | None, conn: socket.socket | None) -> None:
        self._listener, self._conn = listener, conn
        self._buffer = bytearray()
        self._scratch = bytearray(self.READ_BYTES)
        self.closed = False
        if conn is not None:
            self._configure(conn)

    @classmethod
    def listen(cls, path: str) -> StepLink:
        """The worker's end, listening at path (a Unix socket path, replaced if it exists)."""
        if os.path.exists(path):
            os.unlink(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        listener.setblocking(False)
        return cls(listener, None)

    @classmethod
    def connect(cls, path: str, timeout_s: float = 60.0) -> StepLink:
        """The scheduler's end: connects to the worker listening at path, retrying until it
        listens (up to timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(path)
                return cls(None, conn)
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"no GPU worker listens at {path}") from None
                time.sleep(0.01)

    def _configure(self, conn: socket.socket) -> None:
        """Large buffers; the socket stays blocking (sends wait while the buffer is full) and
        each read is made non-blocking by its flag."""
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.BUFFER_BYTES)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.BUFFER_BYTES)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def send(self, message: Any) -> None:
        """Send one message, waiting only while the socket's buffer is full."""
        if self._conn is None or self.closed:
            raise ConnectionError("the step link is not connected (its peer is gone)")
        data = codec.encode(message)
        self._conn.sendall(self.HEADER.pack(len(data)) + data)

    def try_recv(self) -> Any | None:
        """The next message if one has arrived whole, else None (never waits)."""
        if self._conn is None:
            self._accept()
            return None
        message = self._take()
        if message is not None or self.closed:
            return message
        try:
            n = self._conn.recv_into(self._scratch, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
        if not n:  # the peer closed its end
            self.closed = True
            return None
        self._buffer += memoryview(self._scratch)[:n]
        return self._take()

    def _take(self) -> Any | None:
        """A whole message from the front of the buffer, if there is one."""
        size = self.HEADER.size
        if len(self._buffer) < size:
            return None
        (length,) = self.HEADER.unpack_from(self._buffer)
        if len(self._buffer) < size + length:
            return None
        data = bytes(memoryview(self._buffer)[size : size + length])
        del self._buffer[: size + length]
        return codec.decode(data)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        self._configure(conn)
        self._conn = conn

    def poll_target(self) -> socket.socket | None:
        """What `Inbox` waits on: the listener until the peer is accepted, then the
        connection; None once closed."""
        if self.closed:
            return None
        return self._conn if self._conn is not None else self._listener

    def close(self) -> None:
        for sock in (self._conn, self._listener):
            if sock is not None:
                sock.close()
        self.closed = True


class Inbox:
    """Several sources (`Receiver`s, `StepLink`s) read as one inbox."""

    def __init__(self, *sources: Receiver | StepLink) -> None:
        self.sources = sources

    def recv(self, timeout_s: float | None = None, spin_s: float = 0.0) -> Any | None:
        """The next message from any source, or None if none came within timeout_s (None
        waits forever).

        spin_s: first look for it without sleeping for up to this long, then block for the
        rest of timeout_s. A process that expects a message within a millisecond or two (the
        scheduler waiting for a step's result) spins: waking from a blocking poll costs tens
        to hundreds of microseconds on a loaded server, paid on every step."""
        message = self._first()
        if message is not None or timeout_s == 0:
            return message
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        spin_end = time.perf_counter() + spin_s
        while time.perf_counter() < spin_end:
            message = self._first()
            if message is not None:
                return message
        while True:
            poller = zmq.Poller()
            for source in self.sources:
                target = source.poll_target()
                if target is not None:
                    poller.register(target, zmq.POLLIN)
            left = None if deadline is None else max(deadline - time.perf_counter(), 0.0)
            poller.poll(None if left is None else int(left * 1000))
            message = self._first()
            if message is not None or (deadline is not None and time.perf_counter() >= deadline):
                return message

    def drain(self) -> list[Any]:
        """Every message available now, without waiting."""
        messages = []
        while (message := self._first()) is not None:
            messages.append(message)
        return messages

    def _first(self) -> Any | None:
        for source in self.sources:
            message = source.try_recv()
            if message is not None:
                return message
        return None


class AsyncSender:
    def __init__(self, address: str, context: zmq.asyncio.Context | None = None) -> None:
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.PUSH)
        _configure(self._socket)
        self._socket.connect(address)

    async def send(self, message: Any) -> None:
        await self._socket.send(codec.encode(message))

    def close(self) -> None:
        self._socket.close()


class AsyncReceiver:
    def __init__(self, address: str, context: zmq.asyncio.Context | None = None) -> None:
        self._socket = (context or zmq.asyncio.Context.instance()).socket(zmq.PULL)
        _configure(self._socket)
        self._socket.bind(address)

    async def recv(self) -> Any:
        return codec.decode(await self._socket.recv())

    def close(self) -> None:
        self._socket.close(linger=0)
