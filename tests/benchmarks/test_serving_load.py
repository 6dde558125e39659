"""The serving benchmarks' load generator: event fields, per-token ITL, the streaming client
against a scripted server, several client processes, and bench_serving's report keys."""

from __future__ import annotations

import json
import math

import pytest
import uvloop

from benchmarks import bench_serving
from benchmarks.serving_load import (
    Payload,
    RequestResult,
    StreamTimer,
    event_fields,
    run_load,
    run_load_processes,
    send_request,
    token_itl,
)
from benchmarks.sse_client import ConnectionPool
from tests.benchmarks.sse_server import CLOSE, ScriptedServer, chunked_sse

TRICKY = 'a "meta_info": {"completion_tokens": 99} \\" \n 世界 🙂'


def native(
    text: str,
    tokens: int,
    accept: float | None = None,
    index: int | None = None,
    compact: bool = False,
) -> str:
    """A native event; compact: without spaces and spec_accept_length (as SGLang writes it)."""
    meta = {
        "id": 'x"meta_info": "completion_tokens": 1',
        "completion_tokens": tokens,
        "spec_accept_length": accept,
        "output_token_logprobs": [[-0.5, 1, None]] * tokens,
    }
    if compact:
        del meta["spec_accept_length"]
    event = {"text": text, "output_ids": list(range(tokens)), "meta_info": meta}
    if index is not None:
        event["index"] = index
    return json.dumps(event, ensure_ascii=False, separators=(",", ":") if compact else None)


def openai(text: str, usage: int | None = None) -> str:
    choices = [{"index": 0, "text": text, "finish_reason": None}] if usage is None else []
    counts = None if usage is None else {"completion_tokens": usage}
    return json.dumps({"id": "cmpl-1", "choices": choices, "usage": counts})


def full_parse(data: str) -> tuple:
    """The fields read the slow way, as the client read every event before."""
    event = json.loads(data)
    meta, usage, choices = (
        event.get("meta_info") or {},
        event.get("usage") or {},
        event.get("choices") or [],
    )
    has_text = bool(event.get("text") or (choices and choices[0].get("text")))
    return (
        has_text,
        usage.get("completion_tokens") or meta.get("completion_tokens"),
        meta.get("spec_accept_length"),
    )


@pytest.mark.parametrize(
    "data",
    [
        native(TRICKY, 7, 1.75),
        native("", 2),
        native('"', 3, index=1),
        native("x", 0),
        native(TRICKY, 4, compact=True),
        native("", 1, compact=True),
        openai("hi"),
        openai(""),
        openai("", usage=12),
        '{"error": {"code": 500}}',
    ],
)
def test_event_fields_read_what_a_full_parse_reads(data):
    assert event_fields(data.encode()) == full_parse(data)


def test_stream_timer_counts_the_tokens_each_event_adds():
    result = RequestResult(prompt_len=3)
    timer = StreamTimer(result, start=10.0)
    for tokens, now in [(0, 10.5), (2, 11.0), (3, 11.2), (3, 11.3), (7, 12.0)]:
        timer.on_event(native("t" * tokens, tokens).encode(), now)
    timer.on_event(b"[DONE]", 12.5)
    timer.on_event(native("late", 9).encode(), 13.0)  # after [DONE]: ignored
    assert result.ttft == pytest.approx(1.0)  # the event without text is no first token
    assert result.itl == pytest.approx([0.2, 0.1, 0.7])
    assert result.itl_tokens == [1, 0, 4]
    assert result.output_len == 7


def test_token_itl_spreads_each_gap_over_its_tokens_and_carries_empty_gaps():
    assert token_itl([0.2, 0.1, 0.7], [1, 0, 4]) == pytest.approx([0.2] + [0.2] * 4)
    assert token_itl([0.3, 0.6], [3, 2]) == pytest.approx([0.1] * 3 + [0.3] * 2)


def test_summary_keeps_its_keys_and_adds_the_per_token_itl_and_cpu_shares():
    results = [RequestResult(4, 5, True, ttft=0.1, latency=0.5, itl=[0.2, 0.2], itl_tokens=[1, 3])]
    summary = bench_serving.summarize(results, 1.0, None)
    old_keys = {
        "completed",
        "failed",
        "duration_s",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "output_throughput",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "e2e_latency_ms",
        "mean_accept_length",
    }
    assert set(summary) == old_keys | {"token_itl_ms", "cpu_share"}
    assert summary["itl_ms"]["median"] == pytest.approx(200.0)
    assert summary["token_itl_ms"]["mean"] == pytest.approx((200 + 3 * 200 / 3) / 4)


def payload(script: list, prompt_len: int = 1) -> Payload:
    return Payload("/generate", {"script": script}, prompt_len)


def test_client_reads_events_split_anywhere_and_reuses_the_connection():
    events = [native(TRICKY * k, k) for k in (1, 2, 5)]
    with ScriptedServer() as server:

        async def run():
            pool = ConnectionPool(server.url)
            first = await send_request(pool, payload(chunked_sse(events, split=7)))
            second = await send_request(pool, payload(chunked_sse(events, split=0)))
            kept = Payload("/generate", {"script": chunked_sse(events, split=3)}, 1, True)
            third = await send_request(pool, kept)
            pool.close()
            return first, second, third

        results = uvloop.run(run())
        assert server.connections == 1
    for result in results:
        assert result.success and not result.error
        assert result.output_len == 5 and result.itl_tokens == [1, 3] and len(result.itl) == 2
    # The last event's output ids (cumulative), kept only when the payload asks.
    assert [r.output_ids for r in results] == [[], [], [0, 1, 2, 3, 4]]


def test_client_reads_a_content_length_body_and_reports_errors():
    event = f"data: {native('ok', 1)}\n\n"
    sized = [
        [
            0.0,
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            f"content-length: {len(event.encode())}\r\n\r\n{event}",
        ]
    ]
    refused = [[0.0, 'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 11\r\n\r\n{"error": 1}']]
    cut = chunked_sse([native("a", 1), native("ab", 2)])[0][1]
    with ScriptedServer() as server:
        loads = [payload(sized), payload(refused), payload([[0.0, cut[:-40]], [0.0, CLOSE]])]
        results, _ = uvloop.run(run_load(server.url, loads, math.inf, 1, 0))
    assert results[0].success and results[0].output_len == 1
    assert not results[1].success and results[1].error.startswith('HTTP 503: b\'{"error": 1')
    assert not results[2].success and "ConnectionResetError" in results[2].error


def test_client_processes_share_the_requests_and_keep_their_order():
    loads = [payload(chunked_sse([native("t" * k, k)]), prompt_len=k) for k in range(1, 6)]
    with ScriptedServer() as server:
        results, duration, cpu = run_load_processes(server.url, loads, math.inf, 4, 0, 2)
    assert [r.prompt_len for r in results] == [1, 2, 3, 4, 5]
    assert [r.output_len for r in results] == [1, 2, 3, 4, 5]
    assert all(r.success for r in results) and duration > 0 and cpu > 0
