"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Bodies are parsed by `openai_request`; streams follow OpenAI's chunk shapes, written by
`openai_events.OpenAIEvents` and sent by `http_stream.EventStream` (`docs/serving.md`, "The
HTTP APIs").
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenizer_proc.frontend import Frontend
from tokenizer_proc.http_api import (
    SSE_DONE,
    SSE_STOPPING,
    raise_if_stopped,
    read_body,
    wait_all_or_abort,
)
from tokenizer_proc.http_stream import EventStream
from tokenizer_proc.openai_events import OpenAIEvents
from tokenizer_proc.openai_request import OpenAIRequest, parse_openai
from tokenizer_proc.request_tracker import SERVER_STOPPING, RequestState

# ----------------------------------------------------------------------------------------------
# Response shapes


def finish_reason(state: RequestState) -> str | None:
    return state.finish.type if state.finish else None


def usage(state: RequestState) -> dict[str, int]:
    prompt, completion = state.prompt_tokens, state.completion_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": state.cached_tokens},
    }


def logprobs_body(
    frontend: Frontend, req: OpenAIRequest, ids: list[int], lps: list[float], offset: int = 0
) -> dict[str, Any] | None:
    """OpenAI logprobs for ids (sampled-token logprobs only); None when not requested."""
    if not req.logprobs:
        return None
    tokens = frontend.tokenizer.token_strings(ids)
    if req.kind == "chat":
        content = []
        for tok, lp in zip(tokens, lps, strict=False):
            entry = {"token": tok, "logprob": lp, "bytes": list(tok.encode())}
            top = [dict(entry)] if req.top_logprobs else []
            content.append({**entry, "top_logprobs": top})
        return {"content": content}
    offsets = []
    for tok in tokens:
        offsets.append(offset)
        offset += len(tok)
    top = [{t: lp} for t, lp in zip(tokens, lps, strict=False)] if req.top_logprobs else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def envelope(req: OpenAIRequest, state: RequestState, choices: list, chunk: bool) -> dict:
    prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
    obj = req.object_prefix + (".chunk" if chunk and req.kind == "chat" else "")
    return {
        "id": prefix + state.rid,
        "object": obj,
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
    }


def full_response(frontend: Frontend, req: OpenAIRequest, state: RequestState) -> dict:
    lps = logprobs_body(frontend, req, state.output_ids, state.logprobs)
    choice: dict[str, Any] = {"index": 0, "logprobs": lps, "finish_reason": finish_reason(state)}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": state.text}
    else:
        choice["text"] = state.text
    return {**envelope(req, state, [choice], chunk=False), "usage": usage(state)}


async def stream_openai(
    frontend: Frontend, req: OpenAIRequest, state: RequestState
) -> AsyncIterator[bytes]:
    """OpenAI SSE chunks for one request; aborts it if the client goes away. A request the
    server stops ends with an error event (`SSE_STOPPING`) instead of its finishing chunk."""
    events = OpenAIEvents(req, state, frontend.tokenizer.token_strings)
    try:
        if req.kind == "chat":
            yield events.role()
        async for chunk in state.chunks():
            if chunk.text or chunk.output_ids:
                yield events.content(chunk)
        if state.finish == SERVER_STOPPING:
            yield SSE_STOPPING + SSE_DONE
            return
        yield events.finish()
        if req.include_usage:
            yield events.usage()
        yield SSE_DONE
    finally:
        frontend.abort_unfinished([state])


# ----------------------------------------------------------------------------------------------
# Routes


def add_openai_routes(app: FastAPI, frontend: Frontend) -> None:
    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": frontend.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "aerie",
            "root": frontend.model_name,
            "max_model_len": frontend.limits.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_openai(frontend, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_openai(frontend, request, "chat")


async def serve_openai(frontend: Frontend, request: Request, kind: str) -> Response:
    body = await read_body(request, frontend.executor)
    frontend.check_accepting()
    req = await parse_openai(frontend, body, kind)
    (state,) = await frontend.submit([req.prepared], req.stream, req.logprobs)
    if req.stream:
        events = stream_openai(frontend, req, state)
        return EventStream(events)
    if not await wait_all_or_abort(frontend, request, [state]):
        return Response(status_code=499)
    raise_if_stopped([state])
    return JSONResponse(full_response(frontend, req, state))
