"""The capture loop every graph owner shares, and the batch-size buckets.

A CUDA graph replays a fixed sequence of kernels on fixed buffers; `capture_buckets` records
one per bucket, largest first, into one memory pool, each after eager warm-up runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Iterator

import torch

log = logging.getLogger(__name__)

NUM_WARMUP_RUNS = 2


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic garbage collector off while a graph is captured. A collection that
    frees an unreachable CUDAGraph (an earlier worker's, in a process that builds several)
    destroys its executable graph, which is not permitted while a stream captures: the capture
    is invalidated and fails later with "operation failed due to a previous error during
    capture", at whichever kernel comes next, as often or as rarely as collections happen to
    run during captures. Enter it before `torch.cuda.graph`, which begins capturing on entry."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def capture_buckets(
    buckets: list[int], run: Callable[[int], None], device: torch.device, what: str, pool=None
) -> dict[int, torch.cuda.CUDAGraph]:
    """A CUDA graph of run(bucket) for every bucket: largest first (it allocates the static
    outputs; the smaller ones reuse its memory), each after NUM_WARMUP_RUNS eager runs on the
    capture stream (Triton compiles, cuBLAS picks its kernels), all in one memory pool (`pool`,
    or a new one). Logs the time and memory they took; what: e.g. "decode step, batch sizes"."""
    start = time.perf_counter()
    reserved = torch.cuda.memory_reserved(device)
    pool = pool if pool is not None else torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    graphs: dict[int, torch.cuda.CUDAGraph] = {}
    for bucket in reversed(buckets):
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(NUM_WARMUP_RUNS):
                run(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # The collector off first: torch.cuda.graph begins capturing on entry.
        with no_collection(), torch.cuda.graph(graph, pool=pool, stream=stream):
            run(bucket)
        graphs[bucket] = graph
    torch.cuda.synchronize(device)
    log.info(
        "captured %d CUDA graphs (%s %d..%d) in %.1f s, %.0f MiB",
        len(graphs),
        what,
        buckets[0],
        buckets[-1],
        time.perf_counter() - start,
        (torch.cuda.memory_reserved(device) - reserved) / 2**20,
    )
    return graphs


def batch_size_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_bs (and max_bs itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_bs]
    return sorted({*small, *range(8, max_bs + 1, 8), max_bs})
