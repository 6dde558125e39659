"""What a device tracer costs the host per CUDA graph launch, and what it reads (CUDA only).

    python3 benchmarks/bench_trace_cost.py --kernels 300 --launches 200

A graph of --kernels small kernels replays in bursts with host pauses between them, under each
tracer (none, graphs, graphs-no-kernels, kernels: torch.profiler last, since it stays attached):
host time per replay, records, and the idle share read against CUDA events'.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from gpu_worker.tooling.cupti_trace import GRAPH_TRACE, MEMCPY, MEMSET, GraphTrace  # noqa: E402
from gpu_worker.tooling.step_profile import KernelTrace, device_gaps  # noqa: E402

TRACERS = ("none", "graphs", "graphs-no-kernels", "kernels")


def make_graph(kernels: int) -> torch.cuda.CUDAGraph:
    x = torch.zeros(4096, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(kernels):
            x.add_(1.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(kernels):
            x.add_(1.0)
    torch.cuda.synchronize()
    return graph


def make_trace(tracer: str) -> GraphTrace | KernelTrace | None:
    if tracer == "graphs-no-kernels":
        return GraphTrace((GRAPH_TRACE, MEMCPY, MEMSET))
    return {"graphs": GraphTrace, "kernels": KernelTrace}.get(tracer, lambda: None)()


def run_bursts(graph: torch.cuda.CUDAGraph, launches: int, burst: int, pause_s: float):
    """Replays in bursts: host us per replay() of each burst, the bursts' CUDA events, wall s."""
    per_launch, events = [], []
    wall = time.perf_counter()
    for _ in range(launches // burst):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        began = time.perf_counter()
        for _ in range(burst):
            graph.replay()
        per_launch.append((time.perf_counter() - began) / burst * 1e6)
        end.record()
        events.append((start, end))
        end.synchronize()
        time.sleep(pause_s)
    torch.cuda.synchronize()
    return per_launch, events, time.perf_counter() - wall


def run(kernels: int, tracer: str, launches: int, burst: int, pause_s: float) -> dict:
    """One tracer's row. Graph tracing starts before the graph is captured (GraphTrace must)."""
    trace = make_trace(tracer)
    if trace:
        trace.start()
    graph = make_graph(kernels)
    run_bursts(graph, burst * 2, burst, pause_s)  # warm-up
    if trace:
        trace.window()
    per_launch, events, wall = run_bursts(graph, launches, burst, pause_s)
    busy = sum(s.elapsed_time(e) for s, e in events) * 1e3
    span = events[0][0].elapsed_time(events[-1][1]) * 1e3
    row = {
        "tracer": tracer,
        "host_us_per_launch": statistics.median(per_launch),
        "wall_s": wall,
        "event_idle_share": 1 - busy / span,
        "event_busy_us_per_launch": busy / launches,
    }
    if trace:
        intervals, records = trace.stop()
        gaps = device_gaps(intervals)
        row.update(
            records=records,
            untraced=getattr(trace, "refused", []),
            traced_idle_share=1 - gaps.busy / gaps.span if gaps.span else 1.0,
            traced_busy_us_per_launch=gaps.busy / launches,
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernels", type=int, default=300)
    parser.add_argument("--launches", type=int, default=200)
    parser.add_argument("--burst", type=int, default=4)
    parser.add_argument("--pause-ms", type=float, default=1.0)
    parser.add_argument("--tracers", default=",".join(TRACERS))
    parser.add_argument("--output", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = [
        run(args.kernels, tracer, args.launches, args.burst, args.pause_ms / 1e3)
        for tracer in args.tracers.split(",")
    ]
    print(
        f"graph of {args.kernels} kernels, {args.launches} launches in bursts of {args.burst}, "
        f"{args.pause_ms} ms pauses"
    )
    for r in rows:
        traced = (
            f"traced idle {100 * r['traced_idle_share']:5.1f}%, busy "
            f"{r['traced_busy_us_per_launch']:7.1f} us/launch, records {r['records']}, "
            f"untraced {r['untraced']}"
            if "records" in r
            else ""
        )
        print(
            f"{r['tracer']:18s} host {r['host_us_per_launch']:7.1f} us/launch, wall "
            f"{r['wall_s']:6.3f} s; events: idle {100 * r['event_idle_share']:5.1f}%, busy "
            f"{r['event_busy_us_per_launch']:7.1f} us/launch; {traced}"
        )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
