"""What one decode plan costs on the host, per stage: the scheduler building it, msgpack
encoding and decoding it, and the worker parsing it into arrays (median microseconds, size).

    python3 benchmarks/bench_plan_codec.py --batch-size 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie import codec  # noqa: E402
from aerie.messages import SamplingParams  # noqa: E402
from gpu_worker.step.plan_arrays import parse_plan  # noqa: E402
from scheduler_proc.plan import build_decode_plan  # noqa: E402
from scheduler_proc.request import Request  # noqa: E402


def decode_batch(batch_size: int, new_slots: int) -> tuple:
    """batch_size decoding requests, each assigned new_slots slots this step: the arguments of
    `build_decode_plan` after the plan id (requests, slot starts, slot lengths, slots)."""
    requests = []
    for i in range(batch_size):
        req = Request(rid=f"r{i}", prompt_ids=[1] * 100, sampling=SamplingParams())
        req.row, req.committed_len, req.needs_start = i + 1, 100, False
        requests.append(req)
    slots = [1000 * (i + 1) + k for i in range(batch_size) for k in range(new_slots)]
    return requests, [100] * batch_size, [new_slots] * batch_size, slots


def median_us(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def measure(batch_size: int, new_slots: int, iters: int) -> dict:
    batch = decode_batch(batch_size, new_slots)
    plan = build_decode_plan(1, *batch)
    data = codec.encode(plan)
    return {
        "batch_size": batch_size,
        "new_slots_per_row": new_slots,
        "bytes": len(data),
        "build_us": median_us(lambda: build_decode_plan(1, *batch), iters),
        "encode_us": median_us(lambda: codec.encode(plan), iters),
        "decode_us": median_us(lambda: codec.decode(data), iters),
        "parse_us": median_us(lambda: parse_plan(plan, batch_size), iters),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", default="1,64,256", help="comma-separated sizes")
    parser.add_argument(
        "--new-slots",
        type=int,
        default=1,
        help="slots newly assigned per row (1: plain decode; the speculative headroom otherwise)",
    )
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [measure(int(bs), args.new_slots, args.iters) for bs in args.batch_size.split(",")]
    print(
        f"{'batch':>6} {'bytes':>7} {'build us':>9} {'encode us':>10} {'decode us':>10} "
        f"{'parse us':>9}"
    )
    for r in rows:
        print(
            f"{r['batch_size']:>6} {r['bytes']:>7} {r['build_us']:>9.1f} {r['encode_us']:>10.1f}"
            f" {r['decode_us']:>10.1f} {r['parse_us']:>9.1f}"
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
