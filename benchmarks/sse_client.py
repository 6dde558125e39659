"""A minimal asyncio HTTP/1.1 client for streamed (SSE) POST responses, cheap per event, so a load
generator does not measure itself. `SSEConnection` parses the head, the framing and the
`data:` lines inside `data_received` and hands each payload to a callback with its arrival
time; `ConnectionPool` keeps connections alive (plain HTTP only).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

OnEvent = Callable[[bytes, float], None]  # (payload after "data:", arrival perf_counter)

HEAD, SIZE, DATA, TRAILER, LENGTH, TO_CLOSE, DONE = range(7)


class SSEConnection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection; one exchange at a time (`post`)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False  # after an exchange: the server keeps the connection open
        self._buf = bytearray()
        self._state = DONE
        self._need = 0
        self._status = 0
        self._body = bytearray()  # a non-200 response's body
        self._sse = b""  # an incomplete SSE line
        self._on_event: OnEvent | None = None
        self._done: asyncio.Future[tuple[int, bytes]] | None = None
        self._got_bytes = False

    # -- asyncio.Protocol -----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._buf += data
        try:
            self._parse(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - a bad response or callback fails the exchange
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state == TO_CLOSE:
            self._finish()
        elif self._done is not None and not self._done.done():
            error = exc or ConnectionResetError("the server closed the connection")
            self._done.set_exception(error)

    # -- the exchange ---------------------------------------------------------------------------

    async def post(
        self, host: str, path: str, body: bytes, on_event: OnEvent, headers: dict | None = None
    ) -> tuple[int, bytes]:
        """POST body (JSON) and stream the response: (status, body of a non-200 response)."""
        assert self.transport is not None and self._state == DONE
        lines = [
            f"POST {path} HTTP/1.1",
            f"Host: {host}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Accept: text/event-stream",
        ]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self._on_event, self._state, self._got_bytes = on_event, HEAD, False
        self._sse, self._body, self.reusable = b"", bytearray(), False
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        return await self._done

    @property
    def got_response_bytes(self) -> bool:
        return self._got_bytes

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()

    # -- parsing --------------------------------------------------------------------------------

    def _parse(self, now: float) -> None:
        buf = self._buf
        while True:
            state = self._state
            if state == SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                size = int(bytes(buf[:end]).split(b";")[0], 16)
                del buf[: end + 2]
                self._need, self._state = size, (DATA if size else TRAILER)
            elif state == DATA:
                if len(buf) < self._need + 2:
                    return
                self._feed(bytes(buf[: self._need]), now)
                del buf[: self._need + 2]
                self._state = SIZE
            elif state == HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                self._read_head(bytes(buf[:end]))
                del buf[: end + 4]
            elif state == TRAILER:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:
                    self._finish()
            elif state == LENGTH:
                if len(buf) < self._need:
                    return
                self._feed(bytes(buf[: self._need]), now)
                del buf[: self._need]
                self._finish()
            elif state == TO_CLOSE:  # the body is everything until the server closes
                if buf:
                    self._feed(bytes(buf), now)
                    buf.clear()
                return
            else:  # DONE: nothing expected
                return

    def _read_head(self, head: bytes) -> None:
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        self._status = int(status_line.split(" ", 2)[1])
        headers = {}
        for line in header_lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        self.reusable = headers.get("connection") != "close"
        if "chunked" in headers.get("transfer-encoding", ""):
            self._state = SIZE
        elif "content-length" in headers:
            self._need, self._state = int(headers["content-length"]), LENGTH
        else:
            self._state, self.reusable = TO_CLOSE, False

    def _feed(self, data: bytes, now: float) -> None:
        if self._status != 200:
            self._body += data
            return
        lines = (self._sse + data).split(b"\n")
        self._sse = lines.pop()
        on_event = self._on_event
        assert on_event is not None
        for line in lines:
            if line.startswith(b"data:"):
                on_event(line[5:].strip(), now)

    def _finish(self) -> None:
        self._state = DONE
        if self._done is not None and not self._done.done():
            self._done.set_result((self._status, bytes(self._body)))

    def _fail(self, error: Exception) -> None:
        self._state, self.reusable = DONE, False
        self.close()
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)


class ConnectionPool:
    """Kept-alive connections to base_url (http://host:port); any number at once."""

    def __init__(self, base_url: str, headers: dict | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the streaming client speaks plain http://host:port, not {base_url}")
        self.host, self.port = parts.hostname, parts.port or 80
        self.host_header = parts.netloc
        self.headers = headers
        self._idle: list[SSEConnection] = []

    async def post_stream(self, path: str, body: bytes, on_event: OnEvent) -> tuple[int, bytes]:
        """POST to path on an idle or new connection: (status, body of a non-200 response).
        A kept-alive connection the server closed before answering is retried once on a new
        one; other connection errors raise OSError."""
        reused = bool(self._idle)
        conn = self._take_idle() or await self._open()
        try:
            result = await conn.post(self.host_header, path, body, on_event, self.headers)
        except ConnectionError:
            conn.close()
            if not reused or conn.got_response_bytes:
                raise
            conn = await self._open()
            result = await conn.post(self.host_header, path, body, on_event, self.headers)
        except BaseException:
            conn.close()
            raise
        if conn.reusable and not conn.closed:
            self._idle.append(conn)
        else:
            conn.close()
        return result

    def _take_idle(self) -> SSEConnection | None:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                return conn
        return None

    async def _open(self) -> SSEConnection:
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(SSEConnection, self.host, self.port)
        return conn

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()
