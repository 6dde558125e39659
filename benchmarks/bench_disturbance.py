"""Do other streams stall? Steady streams against a launched server, then a disturbance.

`--steady` streams of long outputs (OpenAI completions, token-id prompts: each event carries
only its own text) run from `--client-processes` processes; once every one has its first
token and `--settle-s` has passed, the disturbance starts at t0:
- `burst`: `--burst` new streaming requests at once (`--burst-prompt-len` random prompt ids,
  `--burst-output-len` tokens each);
- `prefill`: `--long` requests of `--long-prompt-len` prompt ids (a long prefill, chunked);
- `slow`: `--slow` connections that send a streaming request and never read a byte;
- `none`: nothing (the yardstick: two windows of the same undisturbed run).

For the steady streams it reports the gaps between events (median, p99, max) and events per
second in the window before t0 and in the window after it (`--window-s` each), and the
disturbance's own TTFT. A gap counts in the window its later event arrives in. Arrival times
are `time.perf_counter` (CLOCK_MONOTONIC: one clock for every process of the machine).

    python3 benchmarks/bench_disturbance.py --base-url http://127.0.0.1:30000 --scenario burst
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_serving import describe_ms  # noqa: E402
from benchmarks.sse_client import ConnectionPool  # noqa: E402

SCENARIOS = ("none", "burst", "prefill", "slow")
PATH = "/v1/completions"


@dataclass
class Stream:
    """Arrival times of one stream's events that carry output (the finishing event and
    `[DONE]` do not)."""

    start: float
    events: list[float] = field(default_factory=list)
    finished: bool = False

    def on_event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.finished = True
            return
        choices = json.loads(data).get("choices") or []
        if choices and choices[0].get("finish_reason") is None:
            self.events.append(now)

    @property
    def ttft(self) -> float | None:
        return self.events[0] - self.start if self.events else None


def window_stats(streams: list[list[float]], start: float, end: float) -> dict[str, float]:
    """Over every stream's event times: the gaps between consecutive events whose later event
    arrived in [start, end) (ms: median, p99, max, count) and those events per second."""
    gaps = [
        t1 - t0
        for events in streams
        for t0, t1 in zip(events, events[1:], strict=False)
        if start <= t1 < end
    ]
    ms = describe_ms(gaps)
    return {
        "gaps": len(gaps),
        "gap_median_ms": ms["median"],
        "gap_p99_ms": ms["p99"],
        "gap_max_ms": 1e3 * max(gaps, default=0.0),
        "events_per_s": len(gaps) / (end - start),
    }


def request_body(ids: list[int], max_new: int) -> bytes:
    body = {
        "model": "default",
        "prompt": ids,
        "max_tokens": max_new,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    return json.dumps(body).encode()


async def run_stream(pool: ConnectionPool, stream: Stream, body: bytes) -> str:
    """Stream one request into `stream`; -> an error, or "" (a cancelled stream's connection
    is closed, which aborts the request)."""
    try:
        status, error = await pool.post_stream(PATH, body, stream.on_event)
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "" if status == 200 else f"HTTP {status}: {error[:200]!r}"


def silent_client(host: str, port: int, body: bytes) -> socket.socket:
    """A connection that sends a streaming request and reads nothing (a tiny receive
    buffer, so the server's send buffers fill soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, port))
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def prompt_ids(rng: random.Random, args: argparse.Namespace, n: int) -> list[int]:
    return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]


async def steady_streams(args: argparse.Namespace, index: int, num: int, started, t0) -> dict:
    """num steady streams; reports on `started` once each has its first event, then runs
    until `window_s` after the t0 the main process sets. -> their event times and errors."""
    rng = random.Random(f"{args.seed}/{index}")
    pool, now = ConnectionPool(args.base_url), time.perf_counter()
    streams = [Stream(now) for _ in range(num)]
    bodies = [
        request_body(prompt_ids(rng, args, args.prompt_len), args.output_len) for _ in streams
    ]
    tasks = [
        asyncio.create_task(run_stream(pool, s, b)) for s, b in zip(streams, bodies, strict=True)
    ]
    while any(not s.events for s in streams) and not any(t.done() for t in tasks):
        await asyncio.sleep(0.005)
    started.put(index)
    while t0.value == 0.0:
        await asyncio.sleep(0.005)
    await asyncio.sleep(max(0.0, t0.value + args.window_s - time.perf_counter()))
    finished = sum(s.finished for s in streams)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    pool.close()
    errors = [r for r in results if isinstance(r, str) and r]
    return {"events": [s.events for s in streams], "finished": finished, "errors": errors}


def _steady_process(args, index, num, started, t0, results) -> None:
    results.put((index, uvloop.run(steady_streams(args, index, num, started, t0))))


async def disturb(args: argparse.Namespace, t0: float) -> tuple[list[Stream], int, list[str]]:
    """Start the disturbance at t0 and let it run for the window: (its streams, how many
    requests or connections, errors)."""
    rng = random.Random(args.seed)
    await asyncio.sleep(max(0.0, t0 - time.perf_counter()))
    if args.scenario == "slow":
        host, port = args.base_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        body = request_body(prompt_ids(rng, args, args.prompt_len), args.output_len)
        silent = [silent_client(host, int(port), body) for _ in range(args.slow)]
        await asyncio.sleep(args.window_s)
        for sock in silent:
            sock.close()
        return [], len(silent), []
    if args.scenario == "none":
        await asyncio.sleep(args.window_s)
        return [], 0, []
    count, prompt_len, output_len = (
        (args.burst, args.burst_prompt_len, args.burst_output_len)
        if args.scenario == "burst"
        else (args.long, args.long_prompt_len, args.long_output_len)
    )
    pool, start = ConnectionPool(args.base_url), time.perf_counter()
    streams = [Stream(start) for _ in range(count)]
    bodies = [request_body(prompt_ids(rng, args, prompt_len), output_len) for _ in streams]
    tasks = [
        asyncio.create_task(run_stream(pool, s, b)) for s, b in zip(streams, bodies, strict=True)
    ]
    await asyncio.sleep(max(0.0, t0 + args.window_s - time.perf_counter()))
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    pool.close()
    return streams, count, [r for r in results if isinstance(r, str) and r]


def measure(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    started, results, t0 = ctx.Queue(), ctx.Queue(), ctx.Value("d", 0.0)
    num = min(args.client_processes, args.steady)
    shares = [args.steady // num + (i < args.steady % num) for i in range(num)]
    procs = [
        ctx.Process(target=_steady_process, args=(args, i, n, started, t0, results), daemon=True)
        for i, n in enumerate(shares)
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            started.get(timeout=args.timeout_s)
        t0.value = start = time.perf_counter() + max(args.settle_s, args.window_s)
        others, count, errors = uvloop.run(disturb(args, start))
        steady = dict(results.get(timeout=args.timeout_s) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    events = [e for i in sorted(steady) for e in steady[i]["events"]]
    ttfts = sorted(1e3 * s.ttft for s in others if s.ttft is not None)
    return {
        "scenario": args.scenario,
        "steady": args.steady,
        "window_s": args.window_s,
        "before": window_stats(events, start - args.window_s, start),
        "during": window_stats(events, start, start + args.window_s),
        "disturbance": {
            "requests": count,
            "started": len(ttfts),
            "ttft_median_ms": statistics.median(ttfts) if ttfts else None,
            "ttft_max_ms": ttfts[-1] if ttfts else None,
        },
        "steady_without_output": sum(not e for e in events),
        "steady_finished_early": sum(r["finished"] for r in steady.values()),
        "errors": (errors + [e for r in steady.values() for e in r["errors"]])[:5],
        "args": vars(args),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--scenario", choices=SCENARIOS, default="burst")
    p.add_argument("--steady", type=int, default=64, help="steady streams")
    p.add_argument("--prompt-len", type=int, default=32, help="a steady stream's prompt ids")
    p.add_argument("--output-len", type=int, default=4000, help="a steady stream's tokens")
    p.add_argument("--settle-s", type=float, default=2.0, help="after every stream started")
    p.add_argument("--window-s", type=float, default=2.0, help="before t0, and after it")
    p.add_argument("--burst", type=int, default=256, help="burst: new requests")
    p.add_argument("--burst-prompt-len", type=int, default=256)
    p.add_argument("--burst-output-len", type=int, default=128)
    p.add_argument("--long", type=int, default=4, help="prefill: long requests")
    p.add_argument("--long-prompt-len", type=int, default=7000)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--slow", type=int, default=16, help="slow: connections that never read")
    p.add_argument("--min-token-id", type=int, default=100, help="prompt ids are drawn from")
    p.add_argument("--max-token-id", type=int, default=20000, help="[min, max)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--client-processes", type=int, default=4, help="the steady streams' clients")
    p.add_argument("--timeout-s", type=float, default=120.0, help="for the streams to start")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    for name in ("steady", "client_processes", "burst", "long", "slow"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = measure(args)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    b, d = result["before"], result["during"]
    print(f"{args.scenario}: {args.steady} steady streams; window {args.window_s} s")
    print("          gap median   p99      max  events/s")
    for name, w in (("before", b), ("during", d)):
        print(
            f"  {name:7s} {w['gap_median_ms']:7.2f} {w['gap_p99_ms']:8.2f} "
            f"{w['gap_max_ms']:8.2f} {w.get('events_per_s', 0.0):9.0f}"
        )
    dist = result["disturbance"]
    if dist["ttft_median_ms"] is not None:
        print(
            f"  disturbance: {dist['started']}/{dist['requests']} started, TTFT median "
            f"{dist['ttft_median_ms']:.1f} ms, max {dist['ttft_max_ms']:.1f} ms"
        )
    if result["steady_finished_early"] or result["steady_without_output"] or result["errors"]:
        print(
            f"  warning: {result['steady_finished_early']} steady streams finished early, "
            f"{result['steady_without_output']} had no output; errors: {result['errors']}"
        )
    return result


if __name__ == "__main__":
    main()
