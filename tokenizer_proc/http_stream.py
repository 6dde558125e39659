"""Streamed SSE bodies written straight to the connection: `EventStream`, `DirectBody`.

The process's HTTP protocol offers each request a `DirectBody` in its ASGI scope, and
`EventStream` writes each event through it (the chunk framing and one transport write), not
down the ASGI send chain (`docs/serving.md`, "Streaming delivery"). The head, the body's end
and any event the direct path declines go through ASGI. Direct events skip the middleware,
which is right only while no middleware rewrites a streamed body.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any

import h11
from starlette.responses import StreamingResponse
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

DIRECT_BODY = "aerie.direct_body"  # the scope["extensions"] key


def chunk_frame(data: bytes) -> bytes:
    """data as one chunk of HTTP/1.1 chunked transfer coding (data not empty)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class DirectBody:
    """Writes body pieces of one request's streamed response straight to its transport.

    `write` returns False, writing nothing, whenever uvicorn's own send would do more than
    frame and write: before the response head or after the body's end, once the client is
    gone, while the transport asks the writer to pause, and for HEAD requests or empty pieces.
    The first piece goes through the h11 connection, and its output shows the framing h11
    chose: only when that is the chunked framing `chunk_frame` writes does the writer frame
    later pieces itself (h11 writes a chunk the same way whatever came before, and its state
    machine does not move on body data); otherwise every piece goes on through h11.
    """

    def __init__(self, cycle: RequestResponseCycle) -> None:
        self.cycle = cycle
        self.chunked: bool | None = None  # None: no piece written yet
        self.is_head = cycle.scope["method"] == "HEAD"

    def write(self, data: bytes) -> bool:
        cycle = self.cycle
        if (
            not cycle.response_started
            or cycle.response_complete
            or cycle.disconnected
            or cycle.flow.write_paused
            or self.is_head
            or not data
        ):
            return False
        if self.chunked:
            cycle.transport.write(chunk_frame(data))
            return True
        output = cycle.conn.send(h11.Data(data=data))
        if self.chunked is None:
            self.chunked = output == chunk_frame(data)
        cycle.transport.write(output)
        return True


class DirectBodyProtocol(H11Protocol):
    """uvicorn's h11 protocol, offering each request a `DirectBody` (scope extension
    `DIRECT_BODY`). uvicorn makes a request's cycle and the task that runs the app in
    `handle_events`, and the task starts only on a later turn of the loop, so the scope
    gets the extension before the app sees it."""

    def handle_events(self) -> None:
        before = self.cycle
        super().handle_events()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            cycle.scope.setdefault("extensions", {})[DIRECT_BODY] = DirectBody(cycle)


class EventStream(StreamingResponse):
    """A text/event-stream response whose events (bytes, one SSE event each) go through the
    request's `DirectBody` when it takes them, else through ASGI send. Disconnects are heard
    as `StreamingResponse` hears them."""

    def __init__(self, events: AsyncIterable[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.direct: DirectBody | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.direct = scope.get("extensions", {}).get(DIRECT_BODY)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Any) -> None:
        head = {
            "type": "http.response.start",
            "status": self.status_code,
            "headers": self.raw_headers,
        }
        await send(head)
        direct = self.direct
        async for event in self.body_iterator:
            if direct is None or not direct.write(event):
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
