"""How `bench_decode.py` times and profiles a decode loop: device-event timing of a loop of
steps (with the host's time to issue each), the profiler's kernel counts, and the device's
copy bandwidth (the roofline's denominator)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_loop(device: torch.device, fn: Callable[[], object], steps: int) -> tuple[float, float]:
    """(seconds per step over the whole loop, median host seconds to issue one step)."""
    host_times = []
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    wall = time.perf_counter()
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        host_times.append(time.perf_counter() - t)
    if device.type == "cuda":
        end.record()
        end.synchronize()
        total = start.elapsed_time(end) / 1e3
    else:
        total = time.perf_counter() - wall
    return total / steps, statistics.median(host_times)


def profile_kernels(
    device: torch.device, fn: Callable[[], object], steps: int
) -> tuple[float | None, float | None, list]:
    """(CUDA kernels per step, their summed GPU time per step in ms, the ten costliest kernel
    names with ms per step) from the profiler's device records; Nones on CPU."""
    if device.type != "cuda" or steps <= 0:
        return None, None, []
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        sync(device)
    kernels = [
        e
        for e in prof.events()
        if e.device_type.name == "CUDA"
        and not e.name.startswith(("Memcpy", "Memset", "cudaMemcpy"))
    ]
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name] = by_name.get(e.name, 0.0) + e.device_time / 1e3 / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    busy = sum(by_name.values())
    return len(kernels) / steps, busy, [(name[:80], ms) for name, ms in top]


def measure_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth in bytes/s from a large copy (read + write both counted)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = statistics.median(
        time_loop(device, lambda: dst.copy_(src), 1)[0] for _ in range(repeats)
    )
    return 2 * num_bytes / seconds
