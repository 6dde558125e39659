"""OpenAI stream events written from byte templates (`OpenAIEvents`) against the dicts and
`json.dumps` the stream sent before, byte for byte, for every event of whole streams."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import pytest

from aerie.messages import FinishReason
from tests.tokenizer_proc.harness import Out, apply_output
from tokenizer_proc.openai_api import envelope, logprobs_body, stream_openai, usage
from tokenizer_proc.openai_request import OpenAIRequest
from tokenizer_proc.request_tracker import RequestState

# Texts JSON must escape or keep as they are: quotes, backslashes, control characters, line
# separators, accents, CJK, emoji (outside the BMP), and an empty piece.
PIECES = [
    'He said "hi"',
    " back\\slash\\",
    "\n",
    "\t\r\x01\x1f\x7f",
    " café",
    " 世界",
    "🙂",
    "",
    "\u2028\u2029",
    ' "choices": [',
    " \\u00e9",
    "x",
    "</script>",
]


def token_strings(ids: list[int]) -> list[str]:
    return [PIECES[i % len(PIECES)] for i in ids]


# ----------------------------------------------------------------------------------------------
# The stream as it was built before: a dict per chunk, dumped whole


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def with_usage_field(req: OpenAIRequest, chunk: dict) -> dict:
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def old_content_chunk(frontend, req, state, chunk, text_offset: int) -> dict:
    choice = {
        "index": 0,
        "logprobs": logprobs_body(frontend, req, chunk.output_ids, chunk.logprobs, text_offset),
        "finish_reason": None,
    }
    if req.kind == "chat":
        choice["delta"] = {"content": chunk.text}
    else:
        choice["text"] = chunk.text
    return with_usage_field(req, envelope(req, state, [choice], chunk=True))


def old_finish_chunk(req, state) -> dict:
    reason = state.finish.type if state.finish else None
    choice = {"index": 0, "logprobs": None, "finish_reason": reason}
    if req.kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return with_usage_field(req, envelope(req, state, [choice], chunk=True))


async def old_stream(frontend, req, state):
    if req.kind == "chat":
        role = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        yield sse(with_usage_field(req, envelope(req, state, [role], chunk=True)))
    text_offset = 0
    async for chunk in state.chunks():
        if chunk.text or chunk.output_ids:
            yield sse(old_content_chunk(frontend, req, state, chunk, text_offset))
            text_offset += len(chunk.text)
    yield sse(old_finish_chunk(req, state))
    if req.include_usage:
        yield sse({**envelope(req, state, [], chunk=True), "usage": usage(state)})
    yield "data: [DONE]\n\n"


# ----------------------------------------------------------------------------------------------
# Both streams over the same deltas


class Clock:
    """time.time for both streams: each pair of events reads the same second."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.25


def request(kind: str, logprobs: bool, top: int, include_usage: bool) -> OpenAIRequest:
    return OpenAIRequest(kind, None, 'models/"tiny" é', True, include_usage, logprobs, top)  # type: ignore[arg-type]


def deltas(rid: str) -> list[list[Out]]:
    """Groups of deltas: one delta, several coalesced into one chunk, tokens without text,
    text without tokens, deltas without logprobs, logprobs below the floor (-inf)."""
    num = [0]

    def delta(text: str, num_ids: int = 1, logprobs: list[float] | None = None, **kw):
        ids = [num[0] + i for i in range(num_ids)]
        num[0] += num_ids
        lps = [-0.1 * i - 1e-7 for i in ids] if logprobs is None else logprobs
        return Out(text, ids, lps, **kw)

    groups = [[delta(p)] for p in PIECES]
    groups.append([delta(p, num_ids=2) for p in PIECES])  # coalesced into one chunk
    groups.append([delta("", num_ids=3)])  # tokens, no text
    groups.append([delta("tail", num_ids=0, logprobs=[])])  # text, no tokens
    groups.append([delta("ab", num_ids=2, logprobs=[])])  # tokens without logprobs
    groups.append([delta("c", num_ids=3, logprobs=[-1e30, -math.inf, 0.0])])
    return groups


async def both_streams(req: OpenAIRequest, finish: FinishReason | None, clock: Clock):
    """(new events, old events) of one stream; finish None: aborted after the deltas."""
    rid = "0123456789abcdef"
    frontend = SimpleNamespace(
        tokenizer=SimpleNamespace(token_strings=token_strings), abort_unfinished=lambda states: None
    )
    states = [RequestState(rid, prompt_tokens=5), RequestState(rid, prompt_tokens=5)]
    streams = [stream_openai(frontend, req, states[0]), old_stream(frontend, req, states[1])]
    new, old = [], []

    async def next_pair() -> None:
        clock.now += 0.4  # a new second every few events
        a, b = await anext(streams[0]), await anext(streams[1])
        new.append(a.encode() if isinstance(a, str) else a)
        old.append(b.encode())

    if req.kind == "chat":
        await next_pair()  # the role
    for group in deltas(rid):
        for state in states:
            for d in group:
                apply_output(state, d)
        await next_pair()
    for state in states:
        if finish is None:
            state._push("", [], [], FinishReason("abort", message="aborted by the client"))
        else:
            apply_output(state, Out("", finish=finish))
    while True:
        try:
            await next_pair()
        except StopAsyncIteration:
            return new, old


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("logprobs,top", [(False, 0), (True, 0), (True, 1)])
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_events_equal_the_dumped_dicts(monkeypatch, kind, logprobs, top, include_usage):
    clock = Clock()
    monkeypatch.setattr(time, "time", lambda: clock.now)
    req = request(kind, logprobs, top, include_usage)
    new, old = asyncio.run(both_streams(req, FinishReason("stop", "</s>"), clock))
    assert new == old
    num_groups = len(deltas("x"))
    assert len(new) == (kind == "chat") + num_groups + 1 + include_usage + 1
    assert new[-1] == b"data: [DONE]\n\n"
    assert len({json.loads(e[6:])["created"] for e in new[:-1]}) > 1  # the clock was read
    last_content = json.loads(new[-3 - include_usage][6:])
    assert (last_content["choices"][0]["logprobs"] is not None) == logprobs


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_aborted_stream_equals_the_dumped_dicts(monkeypatch, kind):
    clock = Clock()
    monkeypatch.setattr(time, "time", lambda: clock.now)
    req = request(kind, True, 1, True)
    new, old = asyncio.run(both_streams(req, None, clock))
    assert new == old
    finish = json.loads(new[-3][6:])
    assert finish["choices"][0]["finish_reason"] == "abort"
