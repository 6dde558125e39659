"""The frontend core (`Frontend`) and the native HTTP API built on it (`create_app`).

`Frontend` is socket-free: it validates and tokenizes request bodies, assigns rids, registers
them with the `RequestTracker` and hands `TokenizedRequest`s to a `Backend` (the real process
sends them to the scheduler; tests pass a fake that feeds `TextDeltas` back into
`frontend.tracker`). It also holds the lifecycle flags (ready, draining) and the metrics.

Native endpoints: POST /generate, GET /health, /health_generate, /server_info, /get_model_info,
/metrics. The OpenAI routes live in `openai_api`.

/generate streaming (SSE): each `data:` event is a full response dict whose `text` and
`output_ids` are CUMULATIVE (everything so far, as SGLang's /generate does) and whose
`meta_info.finish_reason` is null until the last event; a batch adds `"index"` to each event;
the stream ends with `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from aerie.codec import pack_ids
from aerie.messages import FinishReason, SamplingParams, TokenizedRequest
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_tracker import Chunk, RequestState, RequestTracker
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import (
    GenerateBody,
    Limits,
    ValidationError,
    build_sampling_params,
    check_prompt_ids,
    error_body,
    parse_generate_body,
    parse_json_object,
)

log = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


class Backend(Protocol):
    """Where tokenized requests go (the scheduler in the real process)."""

    async def submit(self, request: TokenizedRequest) -> None: ...

    async def abort(self, rid: str) -> None: ...


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request ready to submit."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams


class Frontend:
    """State shared by the HTTP and ZMQ frontends; one per tokenizer process."""

    def __init__(
        self, tokenizer: Tokenizer, limits: Limits, backend: Backend, model_name: str
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.backend = backend
        self.model_name = model_name
        self.metrics = Metrics()
        self.tracker = RequestTracker(
            on_first_output=self.metrics.observe_first_output,
            on_finish=self.metrics.observe_finish,
        )
        self.ready = False
        self.draining = False
        self.server_info: dict[str, Any] = {}
        self._background: set[asyncio.Task] = set()

    # -- lifecycle ------------------------------------------------------------------------------

    def mark_ready(self, server_info: dict[str, Any]) -> None:
        self.server_info = dict(server_info)
        self.ready = True

    def begin_drain(self) -> None:
        self.draining = True

    @property
    def healthy(self) -> bool:
        return self.ready and not self.draining

    def check_accepting(self) -> None:
        """Raise a 503 ValidationError unless new requests are accepted now."""
        if self.draining:
            raise ValidationError("the server is draining; no new requests", status=503)
        if not self.ready:
            raise ValidationError("the engine is not ready yet", status=503)

    # -- requests -------------------------------------------------------------------------------

    def prepare(
        self,
        prompt: str | list[int],
        sampling: dict[str, Any],
        rid: str | None,
        param: str,
        prefix: str = "sampling_params.",
    ) -> Prepared:
        """Tokenize (text) and validate one request. Raises ValidationError."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        check_prompt_ids(ids, self.limits, param)
        params = build_sampling_params(sampling, len(ids), self.limits, prefix)
        return Prepared(self.new_rid(rid), ids, params)

    def prepare_generate(self, body: GenerateBody) -> list[Prepared]:
        param = "text" if body.items and isinstance(body.items[0].prompt, str) else "input_ids"
        return [self.prepare(item.prompt, item.sampling, item.rid, param) for item in body.items]

    def new_rid(self, rid: str | None) -> str:
        if rid is None:
            return uuid.uuid4().hex
        if not rid:
            raise ValidationError("rid must be a non-empty string", "rid")
        if rid in self.tracker:
            raise ValidationError(f"rid {rid!r} is already in flight", "rid")
        return rid

    async def submit(
        self, prepared: list[Prepared], stream: bool, return_logprob: bool
    ) -> list[RequestState]:
        """Register and send each request; returns their states in order."""
        rids = [p.rid for p in prepared]
        if len(set(rids)) != len(rids):
            raise ValidationError("rids in a batch must be distinct", "rid")
        states = [self.tracker.add(p.rid, len(p.input_ids)) for p in prepared]
        try:
            for p in prepared:
                ids = pack_ids(p.input_ids)
                await self.backend.submit(
                    TokenizedRequest(p.rid, ids, p.sampling, stream, return_logprob)
                )
        except BaseException:
            self.abort_unfinished(states)
            raise
        return states

    def abort(self, rid: str) -> None:
        """Drop rid locally and tell the backend (in the background; safe while cancelled)."""
        if not self.tracker.abort(rid):
            return
        task = asyncio.get_running_loop().create_task(self.backend.abort(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_unfinished(self, states: list[RequestState]) -> None:
        for state in states:
            if not state.finished:
                self.abort(state.rid)


# ----------------------------------------------------------------------------------------------
# Response shapes


def finish_dict(finish: FinishReason | None) -> dict[str, Any] | None:
    if finish is None:
        return None
    out: dict[str, Any] = {"type": finish.type, "matched": finish.matched}
    if finish.message:
        out["message"] = finish.message
    return out


def meta_info(
    state: RequestState, return_logprob: bool, chunk: Chunk | None = None
) -> dict[str, Any]:
    """meta_info of state, or of state as it was right after chunk (for stream events)."""
    view = chunk if chunk is not None else state
    spec_ct = view.spec_verify_ct
    end_time = chunk.at if chunk is not None else None
    meta: dict[str, Any] = {
        "id": state.rid,
        "prompt_tokens": view.prompt_tokens,
        "completion_tokens": view.completion_tokens,
        "finish_reason": finish_dict(view.finish),
        "spec_verify_ct": spec_ct,
        "spec_accept_length": view.completion_tokens / spec_ct if spec_ct else None,
        "e2e_latency": (end_time or state.finished_at or time.perf_counter()) - state.created_at,
    }
    if return_logprob:
        num_ids = chunk.ids_end if chunk is not None else len(state.output_ids)
        meta["output_token_logprobs"] = logprob_triples(
            state.logprobs[:num_ids], state.output_ids[:num_ids]
        )
    return meta


def logprob_triples(logprobs: list[float], ids: list[int]) -> list[list[Any]]:
    """SGLang's output_token_logprobs shape: [logprob, token_id, None] per token."""
    return [[lp, tid, None] for lp, tid in zip(logprobs, ids, strict=False)]


def generate_response(
    state: RequestState, return_logprob: bool, chunk: Chunk | None = None
) -> dict[str, Any]:
    """The /generate response dict: cumulative text and ids, of state now or after chunk."""
    text_end = chunk.text_end if chunk is not None else len(state.text)
    ids_end = chunk.ids_end if chunk is not None else len(state.output_ids)
    return {
        "text": state.text[:text_end],
        "output_ids": state.output_ids[:ids_end],
        "meta_info": meta_info(state, return_logprob, chunk),
    }


# ----------------------------------------------------------------------------------------------
# Helpers shared with openai_api


def error_response(e: ValidationError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.param, e.status), status_code=e.status)


async def read_body(request: Request) -> dict[str, Any]:
    return parse_json_object(await request.body())


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
        gone.cancel()
        if not done.done():
            done.cancel()
        frontend.abort_unfinished(states)


async def interleave(states: list[RequestState]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, chunk) as chunks arrive for any of states, until every state finishes."""
    queue: asyncio.Queue[tuple[int, Chunk] | None] = asyncio.Queue()

    async def pump(index: int, state: RequestState) -> None:
        async for chunk in state.chunks():
            queue.put_nowait((index, chunk))
        queue.put_nowait(None)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(states)]
    try:
        remaining = len(states)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------
# App


def create_app(frontend: Frontend) -> FastAPI:
    """The FastAPI app (native + OpenAI routes) serving `frontend`."""
    from tokenizer_proc.openai_api import add_openai_routes

    app = FastAPI(title="Aerie", docs_url=None, redoc_url=None)
    app.state.frontend = frontend

    @app.exception_handler(ValidationError)
    async def on_validation_error(_: Request, e: ValidationError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def on_request_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or None
        return error_response(ValidationError(f"{param}: {err.get('msg', 'invalid')}", param))

    add_native_routes(app, frontend)
    add_openai_routes(app, frontend)
    return app


def add_native_routes(app: FastAPI, frontend: Frontend) -> None:
    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = parse_generate_body(await read_body(request))
        frontend.check_accepting()
        states = await frontend.submit(
            frontend.prepare_generate(body), body.stream, body.return_logprob
        )
        if body.stream:
            events = stream_generate(frontend, states, body.is_batch, body.return_logprob)
            return StreamingResponse(events, media_type="text/event-stream")
        if not await wait_all_or_abort(frontend, request, states):
            return Response(status_code=499)
        out = [generate_response(s, body.return_logprob) for s in states]
        return JSONResponse(out if body.is_batch else out[0])

    @app.get("/health")
    async def health() -> Response:
        if frontend.healthy:
            return Response(status_code=200)
        reason = "draining" if frontend.draining else "not ready"
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
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        info = {"model_path": frontend.model_name, **frontend.server_info}
        info.update(frontend.metrics.live_stats())
        info["num_in_flight"] = frontend.tracker.num_in_flight
        info["draining"] = frontend.draining
        return JSONResponse(info)

    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse(
            {
                "model_path": frontend.model_name,
                "tokenizer_path": frontend.tokenizer.path,
                "is_generation": True,
            }
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=frontend.metrics.content_type)


async def stream_generate(
    frontend: Frontend, states: list[RequestState], is_batch: bool, return_logprob: bool
) -> AsyncIterator[str]:
    """SSE events for /generate; aborts unfinished requests if the client goes away."""
    try:
        async for index, chunk in interleave(states):
            event = generate_response(states[index], return_logprob, chunk)
            if is_batch:
                event["index"] = index
            yield sse(event)
        yield SSE_DONE
    finally:
        frontend.abort_unfinished(states)
