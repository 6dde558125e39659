"""Host time per launch of the small operations an eager forward is made of (CUDA): the library
GEMM through F.linear, `@` and torch.mm, a Triton kernel, an allocation and an add, at 8 and
256 rows of the 135M qkv shape, without synchronising.

    python benchmarks/bench_host_launch.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_worker.kernels import norm  # noqa: E402

CALLS = 2000


def host_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / CALLS * 1e6


def main() -> None:
    torch.manual_seed(0)
    for rows in (8, 256):
        x = torch.randn(rows, 576, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(960, 576, device="cuda", dtype=torch.bfloat16)
        nw = torch.ones(576, device="cuda", dtype=torch.bfloat16)
        cases = {
            "F.linear": lambda: F.linear(x, w),  # noqa: B023 (called in this iteration)
            "x @ w.t()": lambda: x @ w.t(),  # noqa: B023
            "torch.mm": lambda: torch.mm(x, w.t()),  # noqa: B023
            "triton rms_norm": lambda: norm.rms_norm(x, nw, 1e-5),  # noqa: B023
            "torch.empty": lambda: torch.empty_like(x),  # noqa: B023
            "x + x": lambda: x + x,  # noqa: B023
        }
        for name, fn in cases.items():
            print(f"rows {rows:4d} {name:16s} host {host_us(fn):7.1f} us per call", flush=True)


if __name__ == "__main__":
    main()
