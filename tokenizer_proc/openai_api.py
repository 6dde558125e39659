"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Request bodies are mapped onto the native sampling names (`max_tokens` /
`max_completion_tokens` -> `max_new_tokens`, ...) and checked by `validation`; SGLang/vLLM
extensions (top_k, min_p, ignore_eos, repetition_penalty, stop_token_ids, skip_special_tokens)
pass through. One choice per request (n > 1 is a 400). Default max_tokens: 16 for
completions (OpenAI's default), what is left of the context for chat; both clamped to the
context. Logprobs carry the sampled token's logprob (top_logprobs lists only that token).
Streaming follows OpenAI's chunk shapes; `stream_options.include_usage` adds a final chunk
with `usage` and empty `choices`. An aborted request reports finish_reason "abort".
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenizer_proc.frontend import Frontend, Prepared
from tokenizer_proc.http_api import (
    SSE_DONE,
    read_body,
    sse,
    wait_all_or_abort,
)
from tokenizer_proc.request_tracker import Chunk, RequestState
from tokenizer_proc.validation import (
    ValidationError,
    is_id_list,
    kind_of,
    read_bool,
    read_int,
    read_str,
)

_PASSTHROUGH = (
    "temperature", "top_p", "top_k", "min_p", "stop", "seed", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "ignore_eos", "stop_token_ids",
    "skip_special_tokens",
)  # fmt: skip
_ROLES = ("system", "user", "assistant", "tool", "developer")
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    prepared: Prepared
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int

    @property
    def object_prefix(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


# ----------------------------------------------------------------------------------------------
# Parsing


def parse_openai(frontend: Frontend, body: dict[str, Any], kind: str) -> OpenAIRequest:
    """Validate and tokenize a completions (kind="completion") or chat body."""
    n = read_int(body, "n", 1)
    if n != 1:
        raise ValidationError(f"n > 1 is not supported (got n={n}); send n requests", "n")
    if read_bool(body, "echo", False):
        raise ValidationError("echo is not supported", "echo")
    model = read_str(body, "model") or frontend.model_name
    if kind == "chat":
        ids = encode_chat(frontend, read_messages(body))
        logprobs = read_bool(body, "logprobs", False)
        top_logprobs = read_int(body, "top_logprobs", 0) or 0
        if not 0 <= top_logprobs <= 20:
            raise ValidationError("top_logprobs must be in [0, 20]", "top_logprobs")
    else:
        ids = read_completion_prompt(frontend, body)
        top_logprobs = read_int(body, "logprobs", None)  # type: ignore[assignment]
        logprobs = top_logprobs is not None
        if logprobs and not 0 <= top_logprobs <= 5:
            raise ValidationError("logprobs must be in [0, 5]", "logprobs")
        top_logprobs = top_logprobs or 0
    sampling = map_sampling(body, kind, frontend.limits.context_length - len(ids))
    try:
        prepared = frontend.prepare(ids, sampling, None, "prompt", prefix="")
    except ValidationError as e:
        if e.param == "max_new_tokens":
            message = e.message.replace("max_new_tokens", "max_tokens")
            raise ValidationError(message, "max_tokens") from None
        raise
    stream = read_bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValidationError("stream_options must be an object", "stream_options")
    include_usage = read_bool(options, "include_usage", False, "stream_options.include_usage")
    return OpenAIRequest(kind, prepared, model, stream, include_usage, logprobs, top_logprobs)


def map_sampling(body: dict[str, Any], kind: str, room: int) -> dict[str, Any]:
    """Native-named sampling keys from an OpenAI body (defaults for max_tokens applied)."""
    sampling = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None and room > 0:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if kind == "completion" else room
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    return sampling


def encode_chat(frontend: Frontend, messages: list[dict[str, str]]) -> list[int]:
    try:
        return frontend.tokenizer.encode_chat(messages)
    except Exception as e:  # noqa: BLE001 - template errors are the request's fault
        raise ValidationError(f"cannot apply the chat template: {e}", "messages") from e


def read_completion_prompt(frontend: Frontend, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("prompt is empty; send a non-empty prompt", "prompt")
        return frontend.tokenizer.encode(prompt)
    if is_id_list(prompt):
        return prompt  # type: ignore[return-value]
    if isinstance(prompt, list) and prompt:
        raise ValidationError("batched prompts are not supported; send one per request", "prompt")
    raise ValidationError("prompt must be a string or a list of token ids", "prompt")


def read_messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValidationError(f"{param} needs a role, one of {', '.join(_ROLES)}", param)
        out.append({"role": m["role"], "content": read_content(m.get("content"), param)})
    return out


def read_content(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValidationError(f"{param}: only text content parts are supported", param)
            text = part.get("text")
            if not isinstance(text, str):
                where = f"{param}.content[{i}].text"
                raise ValidationError(f"{where} must be a string, got {kind_of(text)}", where)
            parts.append(text)
        return "".join(parts)
    raise ValidationError(f"{param}.content must be a string or a list of parts", param)


# ----------------------------------------------------------------------------------------------
# Response shapes


def finish_reason(state: RequestState) -> str | None:
    return state.finish.type if state.finish else None


def usage(state: RequestState) -> dict[str, int]:
    prompt, completion = state.prompt_tokens, state.completion_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


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
    return {"id": prefix + state.rid, "object": obj, "created": int(time.time()),
            "model": req.model, "choices": choices}  # fmt: skip


def full_response(frontend: Frontend, req: OpenAIRequest, state: RequestState) -> dict:
    lps = logprobs_body(frontend, req, state.output_ids, state.logprobs)
    choice: dict[str, Any] = {"index": 0, "logprobs": lps, "finish_reason": finish_reason(state)}
    if req.kind == "chat":
        choice["message"] = {"role": "assistant", "content": state.text}
    else:
        choice["text"] = state.text
    return {**envelope(req, state, [choice], chunk=False), "usage": usage(state)}


def stream_chunk(
    frontend: Frontend, req: OpenAIRequest, state: RequestState, chunk: Chunk, text_offset: int
) -> dict:
    choice: dict[str, Any] = {
        "index": 0,
        "logprobs": logprobs_body(frontend, req, chunk.output_ids, chunk.logprobs, text_offset),
        "finish_reason": None,
    }
    if req.kind == "chat":
        choice["delta"] = {"content": chunk.text}
    else:
        choice["text"] = chunk.text
    return with_usage_field(req, envelope(req, state, [choice], chunk=True))


def finish_chunk(req: OpenAIRequest, state: RequestState) -> dict:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason(state)}
    if req.kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return with_usage_field(req, envelope(req, state, [choice], chunk=True))


def with_usage_field(req: OpenAIRequest, chunk: dict) -> dict:
    if req.include_usage:
        chunk["usage"] = None
    return chunk


async def stream_openai(
    frontend: Frontend, req: OpenAIRequest, state: RequestState
) -> AsyncIterator[str]:
    """OpenAI SSE chunks for one request; aborts it if the client goes away."""
    try:
        if req.kind == "chat":
            role = {"index": 0, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}  # fmt: skip
            yield sse(with_usage_field(req, envelope(req, state, [role], chunk=True)))
        text_offset = 0
        async for chunk in state.chunks():
            if chunk.text or chunk.output_ids:
                yield sse(stream_chunk(frontend, req, state, chunk, text_offset))
                text_offset += len(chunk.text)
        yield sse(finish_chunk(req, state))
        if req.include_usage:
            yield sse({**envelope(req, state, [], chunk=True), "usage": usage(state)})
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
        return JSONResponse({"object": "list", "data": [card]})  # fmt: skip

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve_openai(frontend, request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve_openai(frontend, request, "chat")


async def serve_openai(frontend: Frontend, request: Request, kind: str) -> Response:
    body = await read_body(request)
    frontend.check_accepting()
    req = parse_openai(frontend, body, kind)
    (state,) = await frontend.submit([req.prepared], req.stream, req.logprobs)
    if req.stream:
        events = stream_openai(frontend, req, state)
        return StreamingResponse(events, media_type="text/event-stream")
    if not await wait_all_or_abort(frontend, request, [state]):
        return Response(status_code=499)
    return JSONResponse(full_response(frontend, req, state))
