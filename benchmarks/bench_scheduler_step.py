"""What one decode step costs the scheduler on the host: applying a result and planning the next
step, with a stand-in worker. Under the overlap schedule it must fit in one GPU step.

    python3 benchmarks/bench_scheduler_step.py --batch-size 1,64,256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.codec import pack_ids, unpack_ids  # noqa: E402
from aerie.config import AerieConfig  # noqa: E402
from aerie.messages import ForwardPlan, SamplingParams, StepResult, TokenizedRequest  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402


def one_token_each(plan: ForwardPlan) -> StepResult:
    """The result a worker would send: one token per sampling request."""
    counts = unpack_ids(plan.sample) if plan.mode == "extend" else [1] * len(unpack_ids(plan.rows))
    return StepResult(
        plan_id=plan.plan_id, num_tokens=pack_ids(counts), token_ids=pack_ids([7] * sum(counts))
    )


def measure(batch_size: int, steps: int, page_size: int) -> dict:
    config = AerieConfig().replace(
        scheduler={"max_running_requests": max(batch_size, 1), "disable_overlap_schedule": True},
        cache={"page_size": page_size, "max_total_tokens": batch_size * (100 + 2 * steps + 64)},
    )
    sched = Scheduler(config, (2,), max_total_tokens=config.cache.max_total_tokens)
    for i in range(batch_size):
        params = SamplingParams(max_new_tokens=2 * steps + 32, temperature=0.0, ignore_eos=True)
        sched.add_request(TokenizedRequest(f"r{i}", pack_ids(list(range(5, 105))), params))
    plan = sched.next_plan()
    while plan.mode != "decode":  # the prefills
        sched.apply_result(plan, one_token_each(plan))
        plan = sched.next_plan()
    times = []
    for step in range(2 * steps):  # the first half warms up
        start = time.perf_counter()
        sched.apply_result(plan, one_token_each(plan))
        plan = sched.next_plan()
        if step >= steps:
            times.append(time.perf_counter() - start)
    if len(sched.running) != batch_size:
        raise RuntimeError(f"only {len(sched.running)} of {batch_size} requests ran")
    median = statistics.median(times) * 1e6
    return {
        "batch_size": batch_size,
        "page_size": page_size,
        "step_us": median,
        "per_request_us": median / batch_size,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", default="1,64,256", help="comma-separated sizes")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = [measure(int(bs), args.steps, args.page_size) for bs in args.batch_size.split(",")]
    print(f"{'batch':>6} {'step us':>9} {'per request us':>15}")
    for r in rows:
        print(f"{r['batch_size']:>6} {r['step_us']:>9.1f} {r['per_request_us']:>15.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
