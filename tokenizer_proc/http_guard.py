"""The HTTP edge: what every request must pass before a route sees it.

`Guard` (ASGI middleware, outermost) checks the Host header (against DNS rebinding), the API
key (/health stays open), a JSON content type on POST bodies (so a browser's "simple" request
cannot drive the API), the body's size and its read time. `edge_protocol` is uvicorn's h11
protocol with a deadline for a new connection's request head, our `--max-connections` cap, and
the cut-off of a client that stops reading (`--slow-client-timeout-s`). Errors are JSON in the
API's format.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import h11

from aerie.access import allowed_host_names, check_api_key, host_without_port
from tokenizer_proc.http_stream import DirectBodyProtocol
from tokenizer_proc.validation import ValidationError, error_body

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})  # reachable without the API key (probes)


@dataclass(frozen=True)
class GuardPolicy:
    api_key: str | None
    allowed_hosts: str | None  # comma list; None: any Host
    max_request_bytes: int
    body_timeout_s: float


class Guard:
    def __init__(self, app: Any, policy: GuardPolicy) -> None:
        self.app = app
        self.policy = policy
        self.allowed = allowed_host_names(policy.allowed_hosts)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        problem = self.check(scope, headers)
        if problem is not None:
            status, message, extra = problem
            await send_error(send, status, message, extra)
            return
        await self.app(scope, self.limited(receive), send)

    def check(self, scope: dict, headers: dict[str, str]) -> tuple[int, str, list] | None:
        """(status, message, extra headers) for a request that may not pass, else None."""
        host = host_without_port(headers.get("host", ""))
        if self.allowed is not None and host not in self.allowed:
            return (
                403,
                (
                    f"the Host header {host[:100]!r} is not allowed; start the server "
                    "with --allowed-hosts to accept it"
                ),
                [],
            )
        if scope["path"] not in OPEN_PATHS and self.policy.api_key is not None:
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            given = token.strip() if scheme.lower() == "bearer" else None
            if not check_api_key(self.policy.api_key, given):
                message = (
                    "missing or invalid API key: send 'Authorization: Bearer <key>' "
                    "with the key the server was started with"
                )
                return 401, message, [(b"www-authenticate", b"Bearer")]
        if scope["method"] == "POST":
            content_type = headers.get("content-type", "").split(";")[0].strip().lower()
            if content_type != "application/json":
                return (
                    415,
                    (
                        "send the body as JSON with 'Content-Type: application/json' "
                        f"(got {content_type[:60] or 'none'!r})"
                    ),
                    [],
                )
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                return 413, self.too_large(), []
        return None

    @property
    def limit(self) -> int:
        return self.policy.max_request_bytes

    def too_large(self) -> str:
        return (
            f"the request body exceeds {self.limit} bytes (--max-request-bytes); "
            "send a shorter prompt"
        )

    def limited(self, receive: Any) -> Any:
        """receive, with the body counted against the size limit and the read deadline. Once
        the body is complete the deadline no longer applies: a handler then awaits receive
        only to hear of a disconnect, for as long as the generation takes."""
        deadline = time.monotonic() + self.policy.body_timeout_s
        received = 0
        body_complete = False

        async def bounded_receive() -> dict:
            nonlocal received, body_complete
            if body_complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0))
            except asyncio.TimeoutError:
                raise ValidationError(
                    f"the request body did not arrive within {self.policy.body_timeout_s:.0f} s",
                    status=408,
                ) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise ValidationError(self.too_large(), status=413)
                body_complete = not message.get("more_body", False)
            return message

        return bounded_receive


async def send_error(send: Any, status: int, message: str, extra: list | None = None) -> None:
    body = json.dumps(error_body(message, None, status)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def cancelled(timer: asyncio.TimerHandle | None) -> None:
    """Cancel timer if there is one; -> None, the handle's new value."""
    if timer is not None:
        timer.cancel()


def edge_protocol(
    header_timeout_s: float,
    max_connections: int | None = None,
    slow_client_timeout_s: float | None = None,
) -> type[DirectBodyProtocol]:
    """uvicorn's h11 protocol, closing a connection whose next request head has not fully
    arrived within header_timeout_s of the connection opening or of the previous response
    (uvicorn's own keep-alive timer stops at the first byte, so it lets slowloris in).
    Streamed events are written as `DirectBodyProtocol` writes them.

    A client that reads nothing while the connection's send buffer stays full (the transport
    asks writers to pause) for slow_client_timeout_s (None: forever) is cut off: the connection
    is reset, which ends its response as a disconnect does (its unfinished requests are
    aborted), and a warning says so; a connection closing after its response (keep-alive
    expiry, `Connection: close`) is cut off the same way, since closing waits for the client
    to read what is buffered. What one connection holds is so bounded by the kernel's and the
    transport's send buffers (a streaming request's newer output coalesces into one pending
    event meanwhile). The clock restarts whenever the client reads enough for the transport's
    buffer to drain below its low-water mark.

    At most max_connections connections (None: any number) are served at once; a request on
    one opened beyond them gets a JSON 503 with Retry-After and the connection is closed.
    (uvicorn's limit_concurrency counts the asking connection among the open ones, so it
    refused the N-th connection instead of the N+1-th, and answers in text/plain.)"""
    served: set[DirectBodyProtocol] = set()  # this server's connections within the cap

    async def refuse(scope: dict, receive: Any, send: Any) -> None:
        message = (
            f"the server is serving its maximum of {max_connections} connections "
            "(--max-connections); retry shortly"
        )
        await send_error(send, 503, message, [(b"retry-after", b"1"), (b"connection", b"close")])

    class EdgeProtocol(DirectBodyProtocol):
        _head_timer: asyncio.TimerHandle | None = None
        _waiting_after: object = None  # the cycle before the awaited request head
        _stall_timer: asyncio.TimerHandle | None = None  # armed while writing is paused

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if max_connections is not None and len(served) >= max_connections:
                self.app = refuse  # every request of this connection; uvicorn reads self.app
            else:
                served.add(self)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._head_timer = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            self._head_timer = cancelled(self._head_timer)

        def _expire(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self._head_timer is not None and self.cycle is not self._waiting_after:
                self._disarm()  # a new request head arrived in time

        def on_response_complete(self) -> None:
            self._arm()  # first: a pipelined head handled inside the call below disarms it
            super().on_response_complete()

        def pause_writing(self) -> None:
            super().pause_writing()
            if slow_client_timeout_s is not None and self._stall_timer is None:
                self._stall_timer = self.loop.call_later(slow_client_timeout_s, self._cut_off)

        def resume_writing(self) -> None:
            super().resume_writing()
            self._stall_timer = cancelled(self._stall_timer)

        def _cut_off(self) -> None:
            # Even a closing transport: close() waits for the client to read what is buffered.
            self._stall_timer = None
            cycle = self.cycle
            path = cycle.scope["path"] if cycle is not None else "-"
            client = "{}:{}".format(*self.client) if self.client else "a client"
            log.warning(
                "cut off %s on %s: it read nothing for %g s with %d KiB unsent; its "
                "unfinished requests are aborted (--slow-client-timeout-s)",
                client,
                path,
                slow_client_timeout_s,
                self.transport.get_write_buffer_size() >> 10,
            )
            self.transport.abort()

        def connection_lost(self, exc: Exception | None) -> None:
            served.discard(self)
            self._disarm()
            self._stall_timer = cancelled(self._stall_timer)
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to a request h11 cannot parse, in JSON; then close."""
            message = "the request is not valid HTTP/1.1; send a well-formed request"
            body = json.dumps(error_body(message, None, 400)).encode()
            headers = [
                (b"content-type", b"application/json"),
                (b"connection", b"close"),
                (b"content-length", str(len(body)).encode()),
            ]
            for event in (
                h11.Response(status_code=400, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return EdgeProtocol
