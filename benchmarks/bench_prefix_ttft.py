"""Time to first token of a chat's next turn with the prefix cache on and off, and what a
request costs when nothing is left to prefill.

    python3 benchmarks/bench_prefix_ttft.py --model-path .device-carry/llama8b \
        --extra-server-args="--load-format dummy" --histories 2000 --output prefix_ttft.json

Each server (`on`: the default, the prefix cache; `off`: `--disable-radix-cache`) is launched and
sent, one request at a time, `--repeats` conversations of random token ids per history length H:
    turn 1   H - --answer-tokens prompt tokens and its answer of --answer-tokens tokens: an
             H-token history, cached as a finished chat turn's is
    turn 2   turn 1, its answer and --new-tokens new tokens, streamed: the second-turn TTFT
    again    turn 2 sent again: all but its last token cached, so its TTFT is the floor a
             request pays whatever is cached (HTTP, the processes' hops, one forward)
Each TTFT is taken at the client (the first streamed event) and in the server (that event's
`e2e_latency`, from the request's arrival in the tokenizer process); the median gap between a
turn 2's later events is the served decode step beside it. The summary divides `off` by `on`.
`--trace` runs the servers with `AERIE_STEP_TRACE` and splits each `again` request's TTFT at
its (first) prefill step's events (`LINKS`): with the cache on, where a request's fixed cost
goes; off, where a whole prefill's time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time

import httpx

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run as a script

from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.sse_client import ConnectionPool  # noqa: E402

SERVERS = {"on": [], "off": ["--disable-radix-cache"]}
# An `again` request's TTFT, link by link: the client's send, its prefill step's events in the
# scheduler and the worker (aerie/step_trace.py), the client's first event. One clock
# (CLOCK_MONOTONIC) in every process of the machine.
LINKS = (
    ("sent", "plan_out", "in: HTTP, tokenizer process, to the scheduler, admission"),
    ("plan_out", "launched", "to the worker, parse, slots, launch"),
    ("launched", "ready", "the prefill on the device"),
    ("ready", "done", "the result back to the scheduler, applied"),
    ("done", "first_event", "out: to the tokenizer process, detokenized there, HTTP"),
)
FIRST_ID = 100  # random ids start past the special tokens


def random_ids(rng: random.Random, num: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(num)]


def id_range(model_path: str) -> int:
    """Ids the model and its tokenizer both know: a shape-only directory may pair a large
    vocabulary with a smaller tokenizer."""
    with open(os.path.join(model_path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tokenizer = os.path.join(model_path, "tokenizer.json")
    if os.path.exists(tokenizer):
        with open(tokenizer) as f:
            vocab = min(vocab, len(json.load(f)["model"]["vocab"]))
    return vocab


class Timed:
    """One streamed request's events: client times and the server's meta of the first."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.sent_ns = time.monotonic_ns()
        self.first_ns = 0
        self.times: list[float] = []
        self.first_meta: dict | None = None

    def on_event(self, data: bytes, now: float) -> None:
        if data == b"[DONE]":
            return
        if self.first_meta is None:
            self.first_ns = time.monotonic_ns()
            self.first_meta = json.loads(data)["meta_info"]
        self.times.append(now)


async def stream(pool: ConnectionPool, ids: list[int], max_new: int) -> dict:
    """TTFT at the client and in the server (ms), cached tokens, the median event gap (ms)."""
    body = {
        "input_ids": ids,
        "stream": True,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }
    timed = Timed(time.perf_counter())
    status, error = await pool.post_stream("/generate", json.dumps(body).encode(), timed.on_event)
    if status != 200 or timed.first_meta is None:
        raise RuntimeError(f"HTTP {status}: {error[:300]!r}")
    gaps = [b - a for a, b in zip(timed.times, timed.times[1:], strict=False)]
    return {
        "ttft_ms": (timed.times[0] - timed.start) * 1e3,
        "server_ttft_ms": timed.first_meta["e2e_latency"] * 1e3,
        "cached_tokens": timed.first_meta["cached_tokens"],
        "gap_ms": statistics.median(gaps) * 1e3 if gaps else None,
        "sent_ns": timed.sent_ns,
        "first_event_ns": timed.first_ns,
    }


def answer(url: str, ids: list[int], num: int) -> list[int]:
    sampling = {"max_new_tokens": num, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(
        url + "/generate", json={"input_ids": ids, "sampling_params": sampling}, timeout=300
    )
    reply.raise_for_status()
    return reply.json()["output_ids"]


async def conversations(url: str, args: argparse.Namespace, vocab: int, history: int) -> list:
    """`args.repeats` conversations at one history length (the same ids on every server)."""
    rng = random.Random(args.seed * 1_000_003 + history)
    pool = ConnectionPool(url)
    rows = []
    try:
        for _ in range(args.warmup + args.repeats):
            turn1 = random_ids(rng, history - args.answer_tokens, vocab)
            new = random_ids(rng, args.new_tokens, vocab)
            turn2 = turn1 + answer(url, turn1, args.answer_tokens) + new
            second = await stream(pool, turn2, args.decode_tokens)
            again = await stream(pool, turn2, args.decode_tokens)
            rows.append({"history": len(turn2) - len(new), "turn2": second, "again": again})
    finally:
        pool.close()
    return rows[args.warmup :]


def median(rows: list[dict], turn: str, key: str) -> float | None:
    values = [r[turn][key] for r in rows if r[turn][key] is not None]
    return round(statistics.median(values), 3) if values else None


def summarize(rows: list[dict]) -> dict:
    out = {"history_tokens": rows[0]["history"]}
    for turn in ("turn2", "again"):
        for key in ("ttft_ms", "server_ttft_ms", "cached_tokens"):
            out[f"{turn}_{key}"] = median(rows, turn, key)
    out["decode_gap_ms"] = median(rows, "turn2", "gap_ms")
    return out


def load_trace(directory: str) -> dict[str, list[tuple[int, int]]]:
    """event -> sorted (time ns, plan id) from the scheduler's and the worker's trace files."""
    events: dict[str, list[tuple[int, int]]] = {}
    for process in ("scheduler", "gpu_worker"):
        with open(os.path.join(directory, f"{process}.json")) as f:
            for event, plan_id, value in json.load(f)["events"]:
                events.setdefault(event, []).append((int(value), plan_id))
    return {event: sorted(times) for event, times in events.items()}


def ttft_split(rows: list[dict], trace: dict[str, list[tuple[int, int]]]) -> dict:
    """Median ms of each link in LINKS over the `again` requests: the prefill step of one is
    the first plan sent after it was (one request at a time)."""
    by_plan: dict[int, dict[str, int]] = {}
    for event, times in trace.items():
        for t, plan_id in times:
            by_plan.setdefault(plan_id, {})[event] = t
    links: dict[str, list[float]] = {what: [] for _, _, what in LINKS}
    links["all (the client's TTFT)"] = []
    for row in rows:
        again = row["again"]
        plan_id = next((p for t, p in trace["plan_out"] if t >= again["sent_ns"]), None)
        if plan_id is None:
            continue
        times = {
            **by_plan[plan_id],
            "sent": again["sent_ns"],
            "first_event": again["first_event_ns"],
        }
        for start, end, what in (*LINKS, ("sent", "first_event", "all (the client's TTFT)")):
            if start in times and end in times:
                links[what].append((times[end] - times[start]) / 1e6)
    return {what: round(statistics.median(v), 3) for what, v in links.items() if v}


def run_server(name: str, args: argparse.Namespace, vocab: int, log_dir: str) -> dict:
    cmd = [sys.executable, "launch.py", "--model-path", args.model_path, "--port", str(args.port)]
    cmd += SERVERS[name] + shlex.split(args.extra_server_args)
    trace_dir = os.path.join(log_dir, f"trace_{name}") if args.trace else None
    env = {"AERIE_STEP_TRACE": f"1,100000000,{trace_dir}"} if trace_dir else None
    print(f"{name}: {shlex.join(cmd)}", flush=True)
    server = LaunchedServer(cmd, os.path.join(log_dir, f"server_{name}.log"), args.startup_s, env)
    result = {"command": shlex.join(cmd), "histories": {}}
    try:
        for history in args.histories:
            rows = asyncio.run(conversations(server.url, args, vocab, history))
            result["histories"][history] = {"summary": summarize(rows), "rows": rows}
            print(f"{name} H={history}: {json.dumps(summarize(rows))}", flush=True)
    finally:
        server.stop()  # the trace files are written as the server stops
    if trace_dir:
        trace = load_trace(trace_dir)
        for history, entry in result["histories"].items():
            entry["ttft_split_ms"] = ttft_split(entry["rows"], trace)
            print(f"{name} H={history} TTFT split (ms): {json.dumps(entry['ttft_split_ms'])}")
    return result


def compare(results: dict) -> list[dict]:
    """Per history length: each server's medians and off / on."""
    table = []
    for history in results["on"]["histories"]:
        on = results["on"]["histories"][history]["summary"]
        off = results["off"]["histories"][history]["summary"]
        row = {"history_tokens": on["history_tokens"], "on": on, "off": off}
        for key in ("turn2_ttft_ms", "turn2_server_ttft_ms"):
            row[f"{key}_off_over_on"] = round(off[key] / on[key], 2)
        table.append(row)
    return table


def print_table(table: list[dict]) -> None:
    print("history | turn-2 TTFT off -> on (ms) | ratio | server-side ratio | floor | decode gap")
    for row in table:
        on, off = row["on"], row["off"]
        print(
            f"{row['history_tokens']:7d} | {off['turn2_ttft_ms']:.1f} -> {on['turn2_ttft_ms']:.1f}"
            f" | {row['turn2_ttft_ms_off_over_on']:.2f}x"
            f" | {row['turn2_server_ttft_ms_off_over_on']:.2f}x"
            f" | {on['again_ttft_ms']:.1f} ms ({on['again_server_ttft_ms']:.1f} in the server)"
            f" | {on['decode_gap_ms']} ms"
        )


def positive_ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: positive integers, comma separated")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--extra-server-args", default="", help="for both servers")
    parser.add_argument(
        "--histories", type=positive_ints, default="2000", help="turn 1 and its answer, tokens"
    )
    parser.add_argument("--answer-tokens", type=int, default=64, help="turn 1's answer")
    parser.add_argument("--new-tokens", type=int, default=64, help="turn 2's new message")
    parser.add_argument("--decode-tokens", type=int, default=16, help="turn 2's answer")
    parser.add_argument("--repeats", type=int, default=10, help="conversations per length")
    parser.add_argument("--warmup", type=int, default=2, help="conversations not counted")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--startup-s", type=float, default=600)
    parser.add_argument("--trace", action="store_true", help="split the TTFT (see above)")
    parser.add_argument("--output", help="JSON results")
    args = parser.parse_args(argv)
    if min(args.histories) <= args.answer_tokens:
        parser.error("each history must be longer than --answer-tokens (turn 1's answer)")
    if args.decode_tokens < 2:
        parser.error("--decode-tokens must be at least 2 (the decode gap needs two events)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    vocab = id_range(args.model_path)
    results = {"args": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = os.path.dirname(os.path.abspath(args.output)) if args.output else tmp
        os.makedirs(log_dir, exist_ok=True)
        for name in SERVERS:
            results[name] = run_server(name, args, vocab, log_dir)
    results["table"] = compare(results)
    print_table(results["table"])
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
