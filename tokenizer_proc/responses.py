"""The /generate response shapes, shared by the HTTP and ZMQ frontends (no web framework here).

`generate_response` builds the dict both return (`text`, `output_ids`, `meta_info`);
`interleave` merges the chunk streams of a batch's requests as they arrive.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
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
    spec_ct = view.spec_verify_ct
    end_time = chunk.at if chunk is not None else None
    meta: dict[str, Any] = {
        "id": state.public_id,
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
