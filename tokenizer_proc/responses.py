"""The /generate response shapes, shared by the HTTP and ZMQ frontends (no web framework here).

`generate_response` builds the dict both return (`text`, `output_ids`, `meta_info`);
`GenerateEvents` writes the same dict of each stream chunk as JSON text, incrementally;
`interleave` merges the chunk streams of a batch's requests as they arrive.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from typing import Any

from aerie.messages import FinishReason
from tokenizer_proc.request_tracker import Chunk, RequestState


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
    meta: dict[str, Any] = {
        "id": state.public_id,
        "prompt_tokens": view.prompt_tokens,
        "cached_tokens": view.cached_tokens,
        "completion_tokens": view.completion_tokens,
        "finish_reason": finish_dict(view.finish),
        "spec_verify_ct": view.spec_verify_ct,
        "spec_accept_length": accept_length(view.completion_tokens, view.spec_verify_ct),
        "e2e_latency": e2e_latency(state, chunk),
        "seed": state.seed,
    }
    if return_logprob:
        num_ids = chunk.ids_end if chunk is not None else len(state.output_ids)
        meta["output_token_logprobs"] = logprob_triples(
            state.logprobs[:num_ids], state.output_ids[:num_ids]
        )
    return meta


def accept_length(completion_tokens: int, spec_verify_ct: int) -> float | None:
    return completion_tokens / spec_verify_ct if spec_verify_ct else None


def e2e_latency(state: RequestState, chunk: Chunk | None) -> float:
    """Seconds from the request's arrival to chunk (to its finish, or now, without one)."""
    end_time = chunk.at if chunk is not None else None
    return (end_time or state.finished_at or time.perf_counter()) - state.created_at


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


class GenerateEvents:
    """The JSON of each /generate stream event of one request, in chunk order, as UTF-8: the
    text of `json.dumps({**generate_response(state, return_logprob, chunk), "index": index},
    ensure_ascii=False)` ("index" only when index is not None), without its O(output) cost.

    The output so far is kept serialized (the escaped text, the ids, the logprob triples) and
    each chunk appends only what it added. Escaping a text piece by piece gives the escaping of
    the whole (JSON escapes character by character), and new items are cut from the state by
    the same absolute positions as `generate_response`. The meta is written field by field in
    `meta_info`'s order (tests hold the two to the same text). `event` takes the state's
    chunks in the order `RequestState.chunks()` yields them.
    """

    def __init__(self, state: RequestState, return_logprob: bool, index: int | None = None):
        self.state = state
        self.return_logprob = return_logprob
        self.tail = b"}" if index is None else b', "index": %d}' % index
        self.id_json = json_text(state.public_id)
        self.seed_json = json_text(state.seed)
        self._text_end = self._ids_end = self._num_triples = 0  # what is serialized so far
        self._text = self._ids = self._triples = b""  # JSON, without quotes / brackets

    def event(self, chunk: Chunk) -> bytes:
        state = self.state
        if chunk.text_end > self._text_end:
            piece = state.text[self._text_end : chunk.text_end]
            self._text += encode_basestring(piece)[1:-1].encode()
            self._text_end = chunk.text_end
        if chunk.ids_end > self._ids_end:
            new = ", ".join(map(str, state.output_ids[self._ids_end : chunk.ids_end])).encode()
            self._ids = self._ids + b", " + new if self._ids else new
            self._ids_end = chunk.ids_end
        meta = self._meta(chunk)
        if self.return_logprob:
            meta += b', "output_token_logprobs": [%b]' % self._logprobs(chunk)
        parts = (
            b'{"text": "',
            self._text,
            b'", "output_ids": [',
            self._ids,
            b'], "meta_info": ',
            meta,
            b"}",
            self.tail,
        )
        return b"".join(parts)

    def _meta(self, chunk: Chunk) -> bytes:
        """meta_info(state, False, chunk) as JSON, less its closing brace."""
        finish = "null" if chunk.finish is None else json_text(finish_dict(chunk.finish))
        accept = number_json(accept_length(chunk.completion_tokens, chunk.spec_verify_ct))
        latency = number_json(e2e_latency(self.state, chunk))
        return (
            f'{{"id": {self.id_json}, "prompt_tokens": {chunk.prompt_tokens}, '
            f'"cached_tokens": {chunk.cached_tokens}, '
            f'"completion_tokens": {chunk.completion_tokens}, "finish_reason": {finish}, '
            f'"spec_verify_ct": {chunk.spec_verify_ct}, "spec_accept_length": {accept}, '
            f'"e2e_latency": {latency}, "seed": {self.seed_json}'
        ).encode()

    def _logprobs(self, chunk: Chunk) -> bytes:
        """The JSON of `logprob_triples` over state's first chunk.ids_end tokens."""
        state, start = self.state, self._num_triples
        triples = [
            f"[{number_json(lp)}, {tid}, null]"
            for lp, tid in zip(
                state.logprobs[start : chunk.ids_end],
                state.output_ids[start : chunk.ids_end],
                strict=False,
            )
        ]
        if triples:
            new = ", ".join(triples).encode()
            self._triples = self._triples + b", " + new if self._triples else new
            self._num_triples += len(triples)
        return self._triples


# Strict: NaN or an infinity raises ValueError instead of writing a token JSON does not have.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def json_text(value: Any) -> str:
    """json.dumps(value, ensure_ascii=False, allow_nan=False), without building an encoder per
    call."""
    return _ENCODER.encode(value)


def number_json(value: float | None) -> str:
    """json_text(value) for None or a float, faster for None and the finite floats (the
    encoder starts a new iteration for anything but a string); a non-finite
    float raises ValueError."""
    if type(value) is float and math.isfinite(value):
        return float.__repr__(value)
    if value is None:
        return "null"
    return json_text(value)


async def interleave(states: list[RequestState]) -> AsyncIterator[tuple[int, Chunk]]:
    """(index, chunk) as chunks arrive for any of states, until every state finishes."""
    if len(states) == 1:  # no pump task or queue for the common case
        async for chunk in states[0].chunks():
            yield 0, chunk
        return
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
