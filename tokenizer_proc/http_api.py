"""The native HTTP API (`create_app`) over the socket-free `Frontend` core: /generate, health,
server info, metrics, /flush_cache and /debug/requests; the OpenAI routes are `openai_api`'s. A
/generate stream's events are cumulative (`docs/serving.md`, "The HTTP APIs").
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Executor
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from aerie.messages import SamplingParams
from tokenizer_proc.frontend import Frontend, Prepared
from tokenizer_proc.http_guard import Guard, GuardPolicy
from tokenizer_proc.http_stream import EventStream
from tokenizer_proc.request_tracker import SERVER_STOPPING, RequestState
from tokenizer_proc.responses import GenerateEvents, generate_response, interleave, json_text
from tokenizer_proc.validation import (
    ValidationError,
    error_body,
    parse_generate_body,
    parse_json_object,
)

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
PARSE_OFF_LOOP_BYTES = 64 << 10  # bodies this large are parsed and checked in a thread


# ----------------------------------------------------------------------------------------------
# Helpers shared with openai_api


def error_response(e: ValidationError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(error_body(e.message, e.param, e.status), e.status, headers=headers)


async def read_body(request: Request, executor: Executor) -> dict[str, Any]:
    """The body as a JSON object (`parse_json_object`); a large one is parsed in executor, so
    that walking a body of many small values (an 8 MB chat of 250,000 messages takes most of a
    second) does not stall the event loop."""
    raw = await request.body()
    if len(raw) < PARSE_OFF_LOOP_BYTES:
        return parse_json_object(raw)
    return await asyncio.get_running_loop().run_in_executor(executor, parse_json_object, raw)


def raise_if_stopped(states: list[RequestState]) -> None:
    """A 503 for requests the server ended because it is stopping: the client should retry."""
    if any(state.finish == SERVER_STOPPING for state in states):
        raise ValidationError(SERVER_STOPPING.message, status=503)


async def wait_disconnect(request: Request) -> None:
    """Return once the HTTP client has gone away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def wait_all_or_abort(
    frontend: Frontend, request: Request, states: list[RequestState]
) -> bool:
    """Wait for every state to finish; on client disconnect abort them and return False."""
    done = asyncio.ensure_future(asyncio.gather(*(s.wait_finished() for s in states)))
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
        return done.done()
    finally:
        gone.cancel()  # on a finished task this marks its exception, if any, as read
        if not done.done():
            done.cancel()
            # A cancelled gather ends holding a CancelledError, which asyncio logs as "exception
            # was never retrieved" once the future is collected unless someone reads it.
            done.add_done_callback(read_outcome)
        frontend.abort_unfinished(states)


def read_outcome(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def sse(data: Any) -> str:
    return f"data: {json_text(data)}\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_STOPPING = sse(error_body(SERVER_STOPPING.message, None, 503)).encode()  # then SSE_DONE


class JsonErrors:
    """ASGI middleware: an exception that escapes a route becomes a JSON 500 in the API's error
    format (an SSE error event when a stream had already started) instead of a bare text 500
    and a reset connection; the keep-alive connection stays usable. Bad input never gets here
    (validation raises ValidationError, a 4xx); this is the net for bugs. A request still
    running when uvicorn's graceful shutdown ends is cancelled: it gets a 503 the same way."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = {"started": False, "done": False, "stream": False}

        def tracked_send(message: dict) -> Awaitable[None]:
            # NOTE: a plain function returning send's awaitable: one coroutine less per event
            if message["type"] == "http.response.start":
                state["started"] = True
                headers = dict(message.get("headers") or [])
                state["stream"] = headers.get(b"content-type", b"").startswith(b"text/event")
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                state["done"] = True
            return send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except ClientDisconnect:  # nobody to answer; one line, no traceback
            log.info(
                "client went away before sending the whole request (%s %s)",
                scope.get("method"),
                scope.get("path"),
            )
        except asyncio.CancelledError:  # answer, then let the cancellation go on
            log.info(
                "answered %s %s with 503: the server stopped before it finished",
                scope.get("method"),
                scope.get("path"),
            )
            await send_final_error(send, state, 503, SERVER_STOPPING.message)
            raise
        except Exception:  # noqa: BLE001 - the one place every unhandled error ends up
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            message = "internal server error; the server log has the details"
            await send_final_error(send, state, 500, message)


async def send_final_error(send: Any, state: dict[str, bool], status: int, message: str) -> None:
    """Answer with an error in the API's format: a JSON response before the response started,
    else an SSE error event and the end of the stream (a non-stream body is just ended)."""
    error = error_body(message, None, status)
    if not state["started"]:
        body = json.dumps(error).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
    elif not state["done"]:
        tail = sse(error).encode() + SSE_DONE if state["stream"] else b""
        await send({"type": "http.response.body", "body": tail})


# ----------------------------------------------------------------------------------------------
# App


def create_app(frontend: Frontend, policy: GuardPolicy | None = None) -> FastAPI:
    """The FastAPI app (native + OpenAI routes) serving `frontend`, behind `Guard` (no key,
    any host and the default limits when policy is None)."""
    from tokenizer_proc.openai_api import add_openai_routes

    app = FastAPI(title="Aerie", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.frontend = frontend
    app.add_middleware(JsonErrors)
    app.add_middleware(Guard, policy=policy or GuardPolicy(None, None, 8 << 20, 30.0))  # outer

    @app.exception_handler(ValidationError)
    async def on_validation_error(_: Request, e: ValidationError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_request_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return error_response(ValidationError(f"{param}: {err.get('msg', 'invalid')}", param))

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        response = error_response(
            ValidationError(http_error_message(app, request, e), status=e.status_code)
        )
        response.headers.update(e.headers or {})  # 405's Allow
        return response

    add_native_routes(app, frontend)
    add_openai_routes(app, frontend)
    return app


def http_error_message(app: FastAPI, request: Request, e: HTTPException) -> str:
    """What the routing errors (404, 405) tell a client to do instead."""
    path = request.url.path[:100]
    if e.status_code == 404:
        paths = sorted({route.path for route in app.routes})
        return f"no endpoint at {path!r}; the endpoints are {', '.join(paths)}"
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return f"{request.method} is not allowed on {path!r}; use {allowed}"
    return str(e.detail)


def add_native_routes(app: FastAPI, frontend: Frontend) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        raw = await read_body(request, frontend.executor)
        body = parse_generate_body(raw, frontend.limits.max_batch_size)
        frontend.check_accepting(len(body.items))
        prepared = await frontend.prepare_generate(body)
        states = await frontend.submit(prepared, body.stream, body.return_logprob)
        if body.stream:
            events = stream_generate(frontend, states, body.is_batch, body.return_logprob)
            return EventStream(events)
        if not await wait_all_or_abort(frontend, request, states):
            return Response(status_code=499)
        raise_if_stopped(states)
        out = [generate_response(s, body.return_logprob) for s in states]
        return JSONResponse(out if body.is_batch else out[0])

    @app.get("/health")
    async def health() -> Response:
        reason = frontend.unhealthy_reason()
        if reason is None:
            return Response(status_code=200)
        return JSONResponse(error_body(f"unhealthy: {reason}", None, 503), status_code=503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        frontend.check_accepting()
        prepared = Prepared(f"health_{uuid.uuid4().hex}", [0], SamplingParams(1, temperature=0))
        (state,) = await frontend.submit([prepared], stream=False, return_logprob=False)
        try:
            await asyncio.wait_for(state.wait_finished(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            frontend.abort(state.rid)
            msg = f"no generation within {HEALTH_GENERATE_TIMEOUT_S}s"
            return JSONResponse(error_body(msg, None, 503), status_code=503)
        raise_if_stopped([state])
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        info = {"model_path": frontend.model_name, **frontend.server_info}  # public values
        capacity = frontend.server_info.get("max_total_tokens", 0)  # one replica's
        replicas = frontend.server_info.get("dp_size", 1)
        info.update(frontend.metrics.live_stats(capacity, replicas))
        info["num_in_flight"] = frontend.tracker.num_in_flight
        info["draining"] = frontend.draining
        return JSONResponse(info)

    @app.get("/debug/requests")
    async def debug_requests() -> JSONResponse:
        """Where each unfinished request is: the tokenizer's tracker and each scheduler's
        queues (`Scheduler.describe`). Only with --enable-debug-info."""
        if not frontend.server_info.get("enable_debug_info"):
            msg = "start the server with --enable-debug-info to see where requests are"
            return JSONResponse(error_body(msg, None, 404), status_code=404)
        schedulers = await frontend.backend.describe()
        return JSONResponse({"tokenizer": frontend.tracker.describe(), "schedulers": schedulers})

    @app.post("/flush_cache")  # POST only: the guard's JSON rule keeps other sites out
    async def flush_cache() -> JSONResponse:
        """Drop every cached prefix that no running request uses (SGLang's endpoint; a
        benchmark's runs then start cold). Answers with what each scheduler still caches and,
        when idle, whether its KV is whole (every page free or cached, none leaked)."""
        replicas = await frontend.backend.describe(flush_cache=True)
        keys = ("replica", "answered", "prefix_cache_tokens", "free_pages", "kv_whole")
        body = [{k: r[k] for k in keys if k in r} for r in replicas]
        ok = all(r["answered"] for r in replicas)
        return JSONResponse({"flushed": ok, "replicas": body}, status_code=200 if ok else 503)

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": frontend.model_name,
                "tokenizer_path": frontend.model_name,
                "is_generation": True,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=frontend.metrics.content_type)


async def stream_generate(
    frontend: Frontend, states: list[RequestState], is_batch: bool, return_logprob: bool
) -> AsyncIterator[bytes]:
    """SSE events for /generate; aborts unfinished requests if the client goes away. Requests
    the server stops end the stream with an error event (`SSE_STOPPING`) instead of their
    finishing event."""
    events = [
        GenerateEvents(state, return_logprob, index if is_batch else None)
        for index, state in enumerate(states)
    ]
    try:
        async for index, chunk in interleave(states):
            if chunk.finish == SERVER_STOPPING:
                if chunk.text or chunk.output_ids:  # what arrived before the stop, unfinished
                    unfinished = dataclasses.replace(chunk, finish=None)
                    yield b"data: %b\n\n" % events[index].event(unfinished)
                yield SSE_STOPPING
                break
            yield b"data: %b\n\n" % events[index].event(chunk)
        yield SSE_DONE
    finally:
        frontend.abort_unfinished(states)
