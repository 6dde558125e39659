"""The `streams` suite: many streams behind 1..N frontends (`--tokenizer-worker-num`), the
default model's shape with random weights, streaming requests of `--output-len` tokens.

For each frontend count a server of its own; at each concurrency `bench_serving.py` sends 2x
that many requests at once (8 at one stream, at most `--max-requests`: the default ShareGPT
subset has about 800 prompts that fit; `prepare --num-conversations 3000` makes room for more)
and reports throughput, TTFT, the gap between a stream's events (median, p99) and each
process's CPU share, the client's included. The runs
are merged into `streams_f<N>.json`; `plot_streams.py` draws them. Then `bench_disturbance.py`
runs `--disturb-steady` steady streams against each of `--disturbances` (a burst of new
requests, long prefills, clients that never read, and nothing, the yardstick), merged into
`disturbance_streams_f<N>.json`. With `--dp-size`, the names end in `_dp<N>`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

from benchmarks.bench_disturbance import SCENARIOS
from benchmarks.runner import Call, Command, Server, Step
from benchmarks.serving_suites import (
    SHAREGPT_SUBSET,
    add_server_flags,
    launch_argv,
    merge_summaries,
)
from benchmarks.suites import SMOLLM2_SHAPE, Suite, bench, int_list, out_file

MAX_REQUESTS = 800


def add_streams(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2_SHAPE, help="model directory, tokenizer included")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument("--frontends", type=int_list, default="1,4", help="a server per count")
    p.add_argument(
        "--concurrency", type=int_list, default="1,16,64,128,256,512", help="streams of each run"
    )
    p.add_argument(
        "--backend",
        choices=("native", "openai"),
        default="native",
        help="streaming /generate or /v1/completions",
    )
    p.add_argument("--output-len", type=int, default=512, help="tokens per request, EOS ignored")
    p.add_argument("--dataset", default=SHAREGPT_SUBSET, help="ShareGPT JSON (prepare makes it)")
    p.add_argument("--client-processes", type=int, default=4, help="bench_serving's clients")
    p.add_argument(
        "--max-requests", type=int, default=MAX_REQUESTS, help="of a run (2 x streams below it)"
    )
    p.add_argument("--max-running-requests", type=int, default=512, help="each replica's rows")
    p.add_argument("--dp-size", type=int, default=1, help="data-parallel replicas (GPUs)")
    p.add_argument(
        "--disturbances",
        default="none,burst,prefill,slow",
        help="bench_disturbance scenarios after the runs ('' for none)",
    )
    p.add_argument("--disturb-steady", type=int, default=128, help="their steady streams")
    add_server_flags(p, timeout_s=300, start_timeout_s=300)


def plan_streams(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = []
    for frontends in args.frontends:
        name = f"streams_f{frontends}" + (f"_dp{args.dp_size}" if args.dp_size > 1 else "")
        server = launch_argv(
            args,
            args.model,
            *("--max-running-requests", str(args.max_running_requests)),
            *("--tokenizer-worker-num", str(frontends)),
            *(("--dp-size", str(args.dp_size)) if args.dp_size > 1 else ()),
        )
        warm = min(max(args.concurrency), args.max_requests)
        inner: list[Step] = [run(args, name, warm, 16, "warmup")]
        inner += [run(args, name, conc, args.output_len) for conc in args.concurrency]
        scenarios = [s for s in args.disturbances.split(",") if s]
        inner += [disturb(args, name, scenario) for scenario in scenarios]
        steps.append(
            Server(server, f"server_{name}.log", args.port, inner, {}, args.start_timeout_s)
        )
        merge = functools.partial(merge_summaries, args.out, name)
        steps.append(Call(f"merge the runs into serving_{name}.json", merge))
        if scenarios:
            merge = functools.partial(merge_disturbances, args.out, name)
            steps.append(Call(f"merge the disturbances into disturbance_{name}.json", merge))
    return steps


def disturb(args: argparse.Namespace, name: str, scenario: str) -> Command:
    argv = bench(
        "bench_disturbance",
        *("--base-url", f"http://127.0.0.1:{args.port}", "--scenario", scenario),
        *("--steady", args.disturb_steady),
        *("--output", out_file(args, f"disturb_{name}_{scenario}.json")),
    )
    return Command(argv, f"disturb_{name}_{scenario}.txt", timeout_s=args.timeout_s)


def merge_disturbances(out: str, name: str) -> None:
    """disturb_<name>_<scenario>.json files into disturbance_<name>.json, without their
    arguments."""
    merged = {}
    paths = [os.path.join(out, f"disturb_{name}_{scenario}.json") for scenario in SCENARIOS]
    for path in filter(os.path.exists, paths):
        with open(path) as f:
            result = json.load(f)
        result.pop("args", None)
        merged[result["scenario"]] = result
        os.remove(path)
    with open(os.path.join(out, f"disturbance_{name}.json"), "w") as f:
        json.dump(merged, f, indent=1)


def run(args: argparse.Namespace, name: str, conc: int, output_len: int, tag: str = "") -> Command:
    """bench_serving.py at `conc` streams (a warm-up when tagged: short requests, not kept)."""
    num = conc if tag else (8 if conc == 1 else min(2 * conc, args.max_requests))
    argv = bench(
        "bench_serving",
        *("--base-url", f"http://127.0.0.1:{args.port}", "--backend", args.backend),
        *("--num-prompts", num, "--max-concurrency", conc, "--output-len", output_len),
        *("--dataset-path", args.dataset, "--tokenizer", args.model),
        *("--client-processes", args.client_processes),
    )
    if not tag:
        argv += ["--output", out_file(args, f"serve_{name}_c{conc}.json")]
    log = f"{tag or 'serve'}_{name}_c{conc}.txt"
    return Command(argv, log, timeout_s=args.timeout_s)


SUITE = Suite(
    "streams",
    "many streams behind 1..N frontends",
    add_streams,
    plan_streams,
    ("wheels", "smollm2-config", "sharegpt_subset.json"),
)
