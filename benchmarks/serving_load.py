"""The serving benchmarks' load generator: stream requests at a rate and a concurrency, time
every event, from one or several client processes.

`send_request` records TTFT, the per-chunk ITL and the tokens each event added; `token_itl`
spreads each gap over its tokens (SGLang's ITL). A native event's counts are read without
parsing its cumulative text. `run_load_processes` splits the load over N client processes.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import queue
import random
import re
import time
from dataclasses import dataclass, field

import uvloop

from benchmarks.sse_client import ConnectionPool

# A native /generate event (this server's, SGLang's) starts with its text and ends with its meta.
NATIVE_START = re.compile(rb'\{"text"\s*:\s*"')
COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
ACCEPT_LENGTH = re.compile(rb'"spec_accept_length"\s*:\s*(null|[-+.eE\d]+)')


@dataclass(frozen=True)
class Payload:
    path: str
    body: dict
    prompt_len: int
    keep_output: bool = False  # a native stream's output ids into its result (`output_ids`)


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds between streamed chunks
    accept_length: float | None = None
    itl_tokens: list[int] = field(default_factory=list)  # tokens of the chunk ending each gap
    output_ids: list[int] = field(default_factory=list)  # with Payload.keep_output


def event_fields(data: bytes) -> tuple[bool, int | None, float | None]:
    """(has text, completion tokens so far or None, spec accept length or None) of one event
    (native or OpenAI shape). A native event is not parsed whole: its meta is its last key,
    and a JSON string escapes every quote, so the last `"meta_info"` in the bytes is that key
    and the meta's own keys after it are found by name."""
    start = NATIVE_START.match(data)
    if start is not None:
        meta = data[data.rfind(b'"meta_info"') :]
        tokens, accept = COMPLETION_TOKENS.search(meta), ACCEPT_LENGTH.search(meta)
        if tokens is not None:
            has_text = data[start.end() : start.end() + 1] != b'"'
            accept_length = None if accept is None or accept[1] == b"null" else float(accept[1])
            return has_text, int(tokens[1]), accept_length
    event = json.loads(data)
    usage = event.get("usage") or {}
    meta = event.get("meta_info") or {}
    choices = event.get("choices") or []
    has_text = bool(event.get("text") or (choices and choices[0].get("text")))
    tokens = usage.get("completion_tokens") or meta.get("completion_tokens")
    return has_text, tokens, meta.get("spec_accept_length")


class StreamTimer:
    """The event callback of one request: fills `result` as events arrive."""

    def __init__(self, result: RequestResult, start: float) -> None:
        self.result = result
        self.start = self.last = start
        self.counted = 0  # completion tokens up to the last event with text
        self.ended = False
        self.last_event = b""  # a native event repeats the output so far: the last holds it all

    def on_event(self, data: bytes, now: float) -> None:
        if self.ended:
            return
        if data == b"[DONE]":
            self.ended = True
            return
        self.last_event = data
        has_text, tokens, accept = event_fields(data)
        result = self.result
        if has_text:
            if result.ttft == 0.0:
                result.ttft = now - self.start
            else:
                result.itl.append(now - self.last)
                result.itl_tokens.append(1 if tokens is None else max(tokens - self.counted, 0))
            self.last = now
            if tokens is not None:
                self.counted = tokens
        if tokens:
            result.output_len = tokens
        if accept:
            result.accept_length = float(accept)


def token_itl(itl: list[float], itl_tokens: list[int]) -> list[float]:
    """Per-token ITL: each gap divided by the tokens its event added, once per token."""
    out: list[float] = []
    carried = 0.0
    for gap, num_tokens in zip(itl, itl_tokens, strict=True):
        carried += gap
        if num_tokens > 0:
            out.extend([carried / num_tokens] * num_tokens)
            carried = 0.0
    return out


async def send_request(pool: ConnectionPool, payload: Payload) -> RequestResult:
    """Stream one request and time its events. Errors are recorded, not raised."""
    result = RequestResult(prompt_len=payload.prompt_len)
    start = time.perf_counter()
    timer = StreamTimer(result, start)
    try:
        body = json.dumps(payload.body).encode()
        status, error_body = await pool.post_stream(payload.path, body, timer.on_event)
    except (OSError, ValueError) as e:  # connection errors; a malformed event
        result.error = f"{type(e).__name__}: {e}"
        return result
    if status != 200:
        result.error = f"HTTP {status}: {error_body[:200]!r}"
        return result
    result.latency = time.perf_counter() - start
    if payload.keep_output and timer.last_event:  # parsed once, after the stream
        result.output_ids = json.loads(timer.last_event).get("output_ids") or []
    result.success = result.ttft > 0.0
    if not result.output_len:  # no usage reported: count chunks (a lower bound)
        result.output_len = len(result.itl) + 1 if result.success else 0
    if not result.success:
        result.error = "no output"
    return result


def arrival_gaps(num: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: Poisson arrivals at `rate`/s, zeros for inf."""
    if math.isinf(rate):
        return [0.0] * num
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(num)]


async def run_load(
    base_url: str, payloads: list[Payload], rate: float, max_concurrency: int | None, seed: int
) -> tuple[list[RequestResult], float]:
    """Send every payload; returns (results in payload order, wall seconds)."""
    semaphore = asyncio.Semaphore(max_concurrency or len(payloads) or 1)
    pool = ConnectionPool(base_url)

    async def limited(payload: Payload) -> RequestResult:
        async with semaphore:
            return await send_request(pool, payload)

    tasks = []
    start = time.perf_counter()
    try:
        for gap, payload in zip(arrival_gaps(len(payloads), rate, seed), payloads, strict=True):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(payload)))
        results = await asyncio.gather(*tasks)
    finally:
        pool.close()
    return list(results), time.perf_counter() - start


def run_load_processes(
    base_url: str,
    payloads: list[Payload],
    rate: float,
    max_concurrency: int | None,
    seed: int,
    num_processes: int,
) -> tuple[list[RequestResult], float, float]:
    """run_load spread over num_processes client processes: (results in payload order, wall
    seconds from the common start to the last finish, client CPU seconds of all of them)."""
    limit = max_concurrency or len(payloads)
    num = max(1, min(num_processes, limit, len(payloads)))
    ctx = mp.get_context("spawn")
    barrier, results_queue = ctx.Barrier(num), ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_process,
            daemon=True,
            args=(
                i,
                base_url,
                payloads[i::num],
                rate / num,
                limit // num + (i < limit % num),
                seed + i,
                barrier,
                results_queue,
            ),
        )
        for i in range(num)
    ]
    for proc in procs:
        proc.start()
    outs = {}
    while len(outs) < num:
        try:
            index, *out = results_queue.get(timeout=1.0)
            outs[index] = out
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process failed (exit code {dead[0]})") from None
    for proc in procs:
        proc.join()
    results: list[RequestResult] = [None] * len(payloads)  # type: ignore[list-item]
    for i in range(num):
        results[i::num] = outs[i][0]
    start = min(out[1] for out in outs.values())
    end = max(out[2] for out in outs.values())
    return results, end - start, sum(out[3] for out in outs.values())


def _client_process(index, base_url, payloads, rate, limit, seed, barrier, results_queue):
    barrier.wait()
    start, cpu = time.perf_counter(), time.process_time()
    results, _ = uvloop.run(run_load(base_url, payloads, rate, limit, seed))
    end = time.perf_counter()
    results_queue.put((index, results, start, end, time.process_time() - cpu))
