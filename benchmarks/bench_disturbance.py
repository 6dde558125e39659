"""Do other streams stall? Steady streams against a launched server, then a disturbance.

`--steady` streams of long outputs run on `/generate`; once every one has its first token and
`--settle-s` has passed, the disturbance starts at t0:
- `burst`: `--burst` new streaming requests at once (`--burst-prompt-len` random prompt ids,
  `--burst-output-len` tokens each);
- `prefill`: `--long` requests of `--long-prompt-len` prompt ids (a long prefill, chunked);
- `slow`: `--slow` connections that send a streaming request and never read a byte;
- `none`: nothing (the yardstick: two windows of the same undisturbed run).

For the steady streams it reports the gaps between events (median, p99, max) and their tokens
per second in the window before t0 and in the window after it (`--window-s` each), and the
disturbance's own TTFT. A gap counts in the window its later event arrives in. One client
process (the steady streams' events at a few hundred streams fit in one).

    python3 benchmarks/bench_disturbance.py --base-url http://127.0.0.1:30000 --scenario burst
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.serving_load import event_fields  # noqa: E402
from benchmarks.sse_client import ConnectionPool  # noqa: E402

SCENARIOS = ("none", "burst", "prefill", "slow")


@dataclass
class Stream:
    """Arrival times and completion-token counts of one stream's events that added tokens."""

    start: float
    events: list[tuple[float, int]] = field(default_factory=list)
    finished: bool = False

    def on_event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            self.finished = True
            return
        _, tokens, _ = event_fields(data)  # counted by tokens: a token may add no text yet
        if tokens and (not self.events or tokens > self.events[-1][1]):
            self.events.append((now, tokens))

    @property
    def ttft(self) -> float | None:
        return self.events[0][0] - self.start if self.events else None


def window_stats(streams: list[Stream], start: float, end: float) -> dict[str, float]:
    """The gaps between consecutive events whose later event arrived in [start, end) (ms:
    median, p99, max, count) and the tokens those events added, per second of the window."""
    gaps: list[float] = []
    tokens = 0
    for stream in streams:
        for (t0, n0), (t1, n1) in zip(stream.events, stream.events[1:], strict=False):
            if start <= t1 < end:
                gaps.append(1e3 * (t1 - t0))
                tokens += n1 - n0
    gaps.sort()
    if not gaps:
        return {"gaps": 0, "gap_median_ms": 0.0, "gap_p99_ms": 0.0, "gap_max_ms": 0.0}
    return {
        "gaps": len(gaps),
        "gap_median_ms": statistics.median(gaps),
        "gap_p99_ms": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "gap_max_ms": gaps[-1],
        "tokens_per_s": tokens / (end - start),
    }


def generate_body(ids: list[int], max_new: int) -> bytes:
    sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    return json.dumps({"input_ids": ids, "sampling_params": sampling, "stream": True}).encode()


async def run_stream(pool: ConnectionPool, stream: Stream, body: bytes) -> str:
    """Stream one request into `stream`; -> an error, or "" (a cancelled stream's connection
    is closed, which aborts the request)."""
    try:
        status, error = await pool.post_stream("/generate", body, stream.on_event)
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
        f"POST /generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


async def measure(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]

    steady_pool, other_pool = ConnectionPool(args.base_url), ConnectionPool(args.base_url)
    now = time.perf_counter()
    steady = [Stream(now) for _ in range(args.steady)]
    tasks = [
        asyncio.create_task(
            run_stream(steady_pool, s, generate_body(ids(args.prompt_len), args.output_len))
        )
        for s in steady
    ]
    deadline = time.perf_counter() + args.timeout_s
    while any(not s.events for s in steady):
        if time.perf_counter() > deadline or any(t.done() for t in tasks):
            errors = [t.result() for t in tasks if t.done() and t.result()]
            raise RuntimeError(f"the steady streams did not all start: {errors[:3]}")
        await asyncio.sleep(0.01)
    await asyncio.sleep(max(args.settle_s, args.window_s))
    t0 = time.perf_counter()
    others: list[Stream] = []
    other_tasks: list[asyncio.Task] = []
    silent: list[socket.socket] = []
    if args.scenario in ("burst", "prefill"):
        count, prompt_len, output_len = (
            (args.burst, args.burst_prompt_len, args.burst_output_len)
            if args.scenario == "burst"
            else (args.long, args.long_prompt_len, args.long_output_len)
        )
        others = [Stream(t0) for _ in range(count)]
        bodies = [generate_body(ids(prompt_len), output_len) for _ in range(count)]
        other_tasks = [
            asyncio.create_task(run_stream(other_pool, s, b))
            for s, b in zip(others, bodies, strict=True)
        ]
    elif args.scenario == "slow":
        host, port = args.base_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        body = generate_body(ids(args.prompt_len), args.output_len)
        silent = [silent_client(host, int(port), body) for _ in range(args.slow)]
    await asyncio.sleep(args.window_s)
    t1 = time.perf_counter()
    finished_early = sum(s.finished for s in steady)
    for task in tasks + other_tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, *other_tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, str) and r]
    for sock in silent:
        sock.close()
    steady_pool.close()
    other_pool.close()
    ttfts = sorted(1e3 * s.ttft for s in others if s.ttft is not None)
    return {
        "scenario": args.scenario,
        "steady": args.steady,
        "window_s": args.window_s,
        "before": window_stats(steady, t0 - args.window_s, t0),
        "during": window_stats(steady, t0, t1),
        "disturbance": {
            "requests": len(others) or len(silent),
            "started": len(ttfts),
            "ttft_median_ms": statistics.median(ttfts) if ttfts else None,
            "ttft_max_ms": ttfts[-1] if ttfts else None,
        },
        "steady_finished_early": finished_early,
        "errors": errors[:5],
        "args": vars(args),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:30000")
    p.add_argument("--scenario", choices=SCENARIOS, default="burst")
    p.add_argument("--steady", type=int, default=64, help="steady streams")
    p.add_argument("--prompt-len", type=int, default=32, help="a steady stream's prompt ids")
    p.add_argument("--output-len", type=int, default=8000, help="a steady stream's tokens")
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
    p.add_argument("--timeout-s", type=float, default=120.0, help="for the streams to start")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    result = uvloop.run(measure(args))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    b, d = result["before"], result["during"]
    print(f"{args.scenario}: {args.steady} steady streams; window {args.window_s} s")
    print("          gap median   p99      max    tok/s")
    for name, w in (("before", b), ("during", d)):
        print(
            f"  {name:7s} {w['gap_median_ms']:7.2f} {w['gap_p99_ms']:8.2f} "
            f"{w['gap_max_ms']:8.2f} {w.get('tokens_per_s', 0.0):8.0f}"
        )
    dist = result["disturbance"]
    if dist["ttft_median_ms"] is not None:
        print(
            f"  disturbance: {dist['started']}/{dist['requests']} started, TTFT median "
            f"{dist['ttft_median_ms']:.1f} ms, max {dist['ttft_max_ms']:.1f} ms"
        )
    if result["steady_finished_early"] or result["errors"]:
        print(f"  warning: {result['steady_finished_early']} finished early; {result['errors']}")
    return result


if __name__ == "__main__":
    main()
