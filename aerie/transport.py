"""The one transport: typed `Sender` / `Receiver` over ZMQ PUSH/PULL, encoded by `aerie.codec`.

A Receiver binds its address (each process owns one inbox); Senders connect. `AsyncReceiver` /
`AsyncSender` are the same API for the asyncio frontend (the tokenizer process) only.
"""

from __future__ import annotations

import time
from typing import Any

import zmq
import zmq.asyncio

from aerie import codec


def _configure(socket: zmq.Socket) -> None:
    # NOTE: a short linger lets a message sent just before close (ProcessFailed, Shutdown)
    # still reach its peer, without ever blocking a process's exit for long.
    socket.setsockopt(zmq.LINGER, 1000)
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

    def recv(self, timeout_s: float | None = None, spin_s: float = 0.0) -> Any | None:
        """The next message, or None if none came within timeout_s (None waits forever).

        spin_s: first look for it without sleeping for up to this long, then block for the
        rest of timeout_s. A process that expects a message within a millisecond or two (the
        scheduler waiting for a step's result) spins: waking from a blocking poll costs tens
        to hundreds of microseconds on a loaded server, paid on every step."""
        if spin_s > 0:
            deadline = time.perf_counter() + spin_s
            while True:
                try:
                    return codec.decode(self._socket.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    if time.perf_counter() >= deadline:
                        break
            if timeout_s is not None:
                timeout_s = max(timeout_s - spin_s, 0.0)
        if timeout_s is not None and not self._socket.poll(int(timeout_s * 1000)):
            return None
        return codec.decode(self._socket.recv(copy=True))

    def drain(self) -> list[Any]:
        """Every message available now, without waiting."""
        messages = []
        while True:
            try:
                data = self._socket.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return messages
            messages.append(codec.decode(data))

    def close(self) -> None:
        self._socket.close(linger=0)


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
