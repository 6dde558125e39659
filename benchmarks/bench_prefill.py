"""What one eager prefill forward of a `ModelRunner` costs the host and the device: N new
tokens of one request after P cached ones, for each (P, N) asked.

    python3 benchmarks/bench_prefill.py --models smollm2,llama3-8b --new 64,2048 --cached 0,2000

For each shape: the host time to launch the forward (until `forward` returns), the time to its
result (after a device sync), medians of --repeats after --warmup; then one profiled forward
per (P, N): the CPU ops and the CUDA kernels that cost most. Random weights; the cached keys
are whatever the pool holds (timing only).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aerie.resolve import resolve_device, resolve_dtype  # noqa: E402
from benchmarks.bench_models import resolve_model  # noqa: E402
from benchmarks.decode_timing import sync  # noqa: E402
from gpu_worker.build import DTYPES  # noqa: E402
from gpu_worker.model_runner import ModelRunner, PoolSpec, RunnerSpec  # noqa: E402
from gpu_worker.step.forward_batch import ForwardMode  # noqa: E402
from gpu_worker.step.host_batch import HostBatch  # noqa: E402

ROW = 1  # the one request's row; position p sits in slot p + 1


def build_runner(path: str, load_format: str, args: argparse.Namespace) -> ModelRunner:
    device = resolve_device(args.device)
    max_len = max(args.cached) + max(args.new) + 1
    backend = args.attention_backend or ("triton" if device == "cuda" else "torch_native")
    spec = RunnerSpec(
        path,
        device=device,
        dtype=DTYPES[resolve_dtype(args.dtype, device)],
        load_format=load_format,
        seed=0,
        attention_backend=backend,
    )
    runner = ModelRunner(spec, PoolSpec(1, max_len, max_len))
    positions = torch.arange(max_len, device=device, dtype=torch.int32)
    runner.req_to_token_pool.req_to_token[ROW, :max_len] = positions + 1
    return runner


def prefill(runner: ModelRunner, cached: int, new: int, vocab: int) -> HostBatch:
    ids = np.random.default_rng(cached + new).integers(0, vocab, new).tolist()
    slots = list(range(cached + 1, cached + new + 1))
    return HostBatch.from_requests(ForwardMode.EXTEND, [ids], [cached], [slots], [ROW])


def time_forward(runner: ModelRunner, host: HostBatch, args: argparse.Namespace) -> dict:
    device = runner.device
    launches, totals = [], []
    for i in range(args.warmup + args.repeats):
        sync(device)
        start = time.perf_counter()
        out = runner.forward(host.to_device(device, runner.staging))
        launched = time.perf_counter()
        out.next_token_logits.sum().item()  # the result on the host: the device is done
        done = time.perf_counter()
        if i >= args.warmup:
            launches.append((launched - start) * 1e3)
            totals.append((done - start) * 1e3)
    return {
        "launch_ms": round(statistics.median(launches), 3),
        "total_ms": round(statistics.median(totals), 3),
    }


def profile_forward(runner: ModelRunner, host: HostBatch, top: int) -> dict:
    """One forward under torch.profiler: the ops of most self CPU time and the kernels of
    most device time (ms, summed by name), and how many kernels ran."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    sync(runner.device)
    with profile(activities=activities) as prof:
        runner.forward(host.to_device(runner.device, runner.staging)).next_token_logits.sum().item()
    cpu: dict[str, float] = {}
    gpu: dict[str, float] = {}
    num_kernels = 0
    for e in prof.events():
        if e.device_type.name == "CUDA":
            num_kernels += 1
            gpu[e.name[:70]] = gpu.get(e.name[:70], 0.0) + e.device_time / 1e3
        else:
            cpu[e.name[:70]] = cpu.get(e.name[:70], 0.0) + e.self_cpu_time_total / 1e3

    def ranked(d: dict[str, float]) -> list:
        return [(k, round(v, 3)) for k, v in sorted(d.items(), key=lambda kv: -kv[1])[:top]]

    return {"kernels": num_kernels, "top_cpu_ms": ranked(cpu), "top_gpu_ms": ranked(gpu)}


def bench_model(name: str, tmp: str, args: argparse.Namespace) -> list[dict]:
    path, load_format = resolve_model(name, tmp, args)
    runner = build_runner(path, load_format, args)
    vocab = runner.config.vocab_size
    rows = []
    with torch.inference_mode():
        for cached in args.cached:
            for new in args.new:
                host = prefill(runner, cached, new, vocab)
                row = {"model": name, "cached": cached, "new": new}
                row.update(time_forward(runner, host, args))
                if args.profile_top:
                    row["profile"] = profile_forward(runner, host, args.profile_top)
                print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
                rows.append(row)
    del runner
    return rows


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    doc = __doc__.split("\n\n", 1)
    parser = argparse.ArgumentParser(
        description=doc[0], epilog=doc[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2", help="smollm2, llama3-8b or directories")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--real-weights", action="store_true", help="smollm2: its real weights")
    parser.add_argument("--new", type=int_list, default="64,2048", help="new tokens, comma list")
    parser.add_argument("--cached", type=int_list, default="0,2000", help="cached tokens")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-top", type=int, default=12, help="0: no profile")
    parser.add_argument("--attention-backend", help="default: triton on CUDA, else torch_native")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    parser.add_argument("--output")
    args = parser.parse_args(argv)
    if min(args.new) < 1 or min(args.cached) < 0:
        parser.error("--new takes positive counts, --cached counts of at least 0")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += bench_model(name, tmp, args)
    for row in rows:
        for kind in ("top_cpu_ms", "top_gpu_ms"):
            listed = ", ".join(f"{n} {ms}" for n, ms in row.get("profile", {}).get(kind, [])[:8])
            print(f"{row['model']} P={row['cached']} N={row['new']} {kind}: {listed}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
