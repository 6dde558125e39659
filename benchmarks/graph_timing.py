"""Per-call time of a kernel launch inside a CUDA graph, as a decode graph runs it: the shared
timer of the kernel benchmarks (bench_small_m_linear.py, bench_decode_attention.py)."""

from __future__ import annotations

import torch


def time_graph(fn, calls: int, repeats: int = 5) -> float:
    """Microseconds per call of fn, replayed `calls` times back to back in one CUDA graph (so a
    figure is the kernel's time plus the gap between graph nodes); the best of `repeats`."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / calls)
    return best
