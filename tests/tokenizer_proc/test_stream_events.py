"""/generate stream events written incrementally (`GenerateEvents`) against the full dump of
`generate_response` that the stream sent before, and `interleave`'s single-request path."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from aerie.messages import FinishReason
from tests.tokenizer_proc import harness
from tests.tokenizer_proc.harness import LOGPROB, Out, apply_output, fake_output_ids, wait_until
from tokenizer_proc.request_tracker import LOGPROB_FLOOR, RequestState
from tokenizer_proc.responses import GenerateEvents, generate_response, interleave

# Text pieces JSON must escape or keep as they are: quotes, backslashes, control characters,
# line separators, accents, CJK, emoji (outside the BMP), empty pieces.
PIECES = [
    'He said "hi"',
    " back\\slash\\",
    "\n",
    "\t\r\x01\x1f",
    " café",
    " 世界",
    "🙂",
    "",
    "\u2028\u2029",
    ' "meta_info": {',
    " \\u00e9",
    "x",
]


def full_dump(state: RequestState, return_logprob: bool, chunk, index: int | None) -> bytes:
    """What the stream sent for chunk before events were built incrementally."""
    event = generate_response(state, return_logprob, chunk)
    if index is not None:
        event["index"] = index
    return json.dumps(event, ensure_ascii=False).encode()


class Feed:
    """Deltas for one request, numbered as the engine counts them."""

    def __init__(self, rid: str) -> None:
        self.rid, self.num_deltas, self.num_tokens = rid, 0, 0

    def delta(self, num_ids: int = 1, **kw) -> Out:
        k = self.num_deltas
        ids = [(7919 * (self.num_tokens + i)) % 50_000 for i in range(num_ids)]
        lps = [-0.1 * (self.num_tokens + i) - 1e-7 for i in range(num_ids)]
        self.num_deltas, self.num_tokens = k + 1, self.num_tokens + num_ids
        return Out(PIECES[k % len(PIECES)], ids, lps, **kw)


async def compare_events(
    state: RequestState, groups: list[list[Out]], return_logprob: bool, index=None
) -> list[bytes]:
    """Apply each group of deltas, then consume the (coalesced) chunk: every event must equal
    the full dump byte for byte. Returns the events."""
    writer = GenerateEvents(state, return_logprob, index)
    chunks = state.chunks()
    events = []
    for group in groups:
        for d in group:
            apply_output(state, d)
        chunk = await anext(chunks)
        events.append(writer.event(chunk))
        assert events[-1] == full_dump(state, return_logprob, chunk, index)
    return events


@pytest.mark.parametrize("return_logprob", [False, True])
@pytest.mark.parametrize("index", [None, 3])
def test_incremental_events_equal_the_full_dump(return_logprob, index):
    state = RequestState("rid0", client_rid='my "rid" é\\', prompt_tokens=5)
    feed = Feed("rid0")
    groups = [[feed.delta()], [feed.delta(), feed.delta(num_ids=3)]]
    groups.append([feed.delta() for _ in range(17)])  # coalesced: many deltas, one event
    groups += [[feed.delta(spec_verify_ct=k)] for k in range(1, 21)]  # accept length: a float
    groups.append([feed.delta(finish=FinishReason("stop", '"stop"\n', "done ✓"))])
    events = asyncio.run(compare_events(state, groups, return_logprob, index))
    assert len(events) == 24
    last = json.loads(events[-1])
    assert last["text"] == state.text and len(state.text) > 100
    assert last["output_ids"] == state.output_ids and len(state.output_ids) == 43
    assert ("index" in last) == (index is not None)


def test_events_with_missing_logprobs_special_floats_and_an_abort():
    """Deltas without logprobs shift the pairing of logprobs and ids (by absolute position,
    as meta_info pairs them); -inf and anything below the floor are written as the floor
    (JSON has no -Infinity); an abort adds an event without tokens."""
    rid = "rid1"
    groups = [
        [Out("a", [1, 2])],
        [Out('"', [3], [-1e30])],
        [Out("\\", [4, 5], [float("-inf"), 1.5])],
    ]

    async def run():
        state = RequestState(rid, prompt_tokens=2)
        events = await compare_events(state, groups, True)
        state._push("", [], [], FinishReason("abort", message="aborted by the client"))
        chunk = await anext(state.chunks())
        assert GenerateEvents(state, True).event(chunk) == full_dump(state, True, chunk, None)
        return events

    last = json.loads(asyncio.run(run())[-1])
    triples = last["meta_info"]["output_token_logprobs"]
    assert [t[1:] for t in triples] == [[1, None], [2, None], [3, None]]
    assert [t[0] for t in triples] == [LOGPROB_FLOOR, LOGPROB_FLOOR, 1.5]


def test_interleave_of_one_state_yields_its_chunks_without_a_task():
    async def run():
        state = RequestState("r")
        apply_output(state, Out("a", [1]))
        apply_output(state, Out("b", [2], finish=FinishReason("length")))
        before = len(asyncio.all_tasks())
        seen = []
        async for index, chunk in interleave([state]):
            seen.append((index, chunk.text, chunk.output_ids))
            assert len(asyncio.all_tasks()) == before
        return seen

    assert asyncio.run(run()) == [(0, "ab", [1, 2])]


def test_batch_stream_over_http_matches_the_engine_output(live, monkeypatch):
    """Escaped text through the live server: each event's cumulative text and ids are the
    engine's so far, with logprobs and the batch index."""
    server, _, engine = live
    monkeypatch.setattr(harness, "fake_text", lambda ids: "".join(PIECES[i % 12] for i in ids))
    body = {
        "input_ids": [[5], [6]],
        "sampling_params": {"max_new_tokens": 6},
        "stream": True,
        "return_logprob": True,
    }
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        raw = r.read()  # NOTE: not iter_lines, which also splits at U+2028 (SSE does not)
    payloads = [e.removeprefix(b"data: ") for e in raw.split(b"\n\n") if e]
    assert payloads[-1] == b"[DONE]"
    by_index: dict[int, list[dict]] = {0: [], 1: []}
    for payload in payloads[:-1]:
        event = json.loads(payload)
        by_index[event["index"]].append(event)
    for index, request in enumerate(engine.submitted):
        ids = fake_output_ids(request)
        for event in by_index[index]:
            n = len(event["output_ids"])
            assert event["output_ids"] == ids[:n]
            assert event["text"] == "".join(PIECES[i % 12] for i in ids[:n])
            triples = event["meta_info"]["output_token_logprobs"]
            assert triples == [[LOGPROB, i, None] for i in ids[:n]]
        assert by_index[index][-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_batch_stream_disconnect_aborts_every_request(live):
    server, frontend, engine = live
    engine.hold = True
    body = {"input_ids": [[5], [6]], "sampling_params": {"max_new_tokens": 8}, "stream": True}
    with httpx.stream("POST", server.url + "/generate", json=body) as r:
        next(r.iter_lines())
    assert wait_until(lambda: sorted(engine.aborted) == sorted(s.rid for s in engine.submitted))
    assert frontend.tracker.num_in_flight == 0
