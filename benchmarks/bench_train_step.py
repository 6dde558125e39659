"""What one training step of `python3 -m training train` costs, and where its GPU time goes.

    python3 benchmarks/bench_train_step.py --model DIR --algorithms eagle3,mtp --shapes 16x1024

For each algorithm and ROWSxLENGTH shape a `Trainer` times its own `train_step` (learning rate
zero, so every variant must give the same loss): the step, the target's part, tokens learned
per second; --profile-steps lists the heaviest kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from training.rows import make_rows  # noqa: E402
from training.soft_ce import set_fused_on_gpu  # noqa: E402
from training.tokens import TokenFile  # noqa: E402
from training.train import TrainConfig, Trainer, synchronize  # noqa: E402


def synthetic_data(
    path: str, rows: int, length: int, prompt_frac: float, spread: float, vocab: int
) -> None:
    """`rows` training sequences and one dev sequence of random tokens."""
    rng = np.random.default_rng(0)
    seqs = [rng.integers(1, vocab, size=length) for _ in range(rows + 1)]
    fracs = rng.uniform(prompt_frac - spread, prompt_frac + spread, size=rows + 1)
    prompt = [min(max(1, int(length * f)), length - 1) for f in fracs]
    dev = np.zeros(rows + 1, dtype=bool)
    dev[-1] = True
    TokenFile.from_sequences(seqs, prompt, dev=dev).save(path)


def measure(args, algorithm: str, shape: str, work: str) -> dict:
    n_rows, length = (int(x) for x in shape.split("x"))
    data = f"{work}/{algorithm}_{shape}.npz"
    with open(Path(args.model) / "config.json") as f:
        vocab = json.load(f)["vocab_size"]
    synthetic_data(data, n_rows, length, args.prompt_frac, args.prompt_spread, vocab)
    cfg = TrainConfig(
        algorithm=algorithm,
        model=args.model,
        data=data,
        out=f"{work}/{algorithm}_{shape}",
        lr=0.0,
        total_steps=10**6,
        tokens_per_batch=n_rows * length,
        max_len=length,
        load_format=args.load_format,
        device=args.device,
    )
    trainer = Trainer(cfg)
    rows = make_rows(trainer.data, trainer.train_idx, length)
    check = None
    if args.check_target and trainer.device.type == "cuda":  # the CPU runs the references only
        check = check_target(trainer, rows)
    results = []
    variants = [
        (loss, window) for loss in args.losses.split(",") for window in args.windows.split(",")
    ]
    for loss, window in variants:
        set_fused_on_gpu(loss == "fused")
        trainer.window = window == "on"
        if trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            trainer.train_step(rows)
        steps = [trainer.train_step(rows) for _ in range(args.steps)]
        step_ms = statistics.median(1e3 * m["step_s"] for m in steps)
        result = {
            "algorithm": algorithm,
            "shape": shape,
            "loss": loss,
            "window": window,
            "step_ms": step_ms,
            "target_ms": statistics.median(1e3 * m["target_s"] for m in steps),
            "learned_tokens_per_s": steps[0]["tokens"] / (step_ms / 1e3),
            "total_loss": steps[-1]["total"],
            "acc": steps[-1]["acc"],
            "target_check": check,
        }
        if trainer.device.type == "cuda":
            result["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile_steps:
            result["profile"] = profile(trainer, rows, args.profile_steps, args.top)
        results.append(result)
    set_fused_on_gpu(True)
    return results


def check_target(trainer: Trainer, rows) -> dict:
    """The target's outputs with the server's Triton kernels against the torch references on
    the same rows: greedy agreement and the largest logit difference (correctness first)."""
    from gpu_worker.layers.layernorm import set_use_triton

    rows = rows.to(trainer.device)
    aux = trainer.recipe.aux_layers
    out = {}
    for use_triton in (True, False):
        set_use_triton(trainer.target.model, use_triton)
        out[use_triton] = trainer.target.run(rows.ids, aux, rows.teaches())
    set_use_triton(trainer.target.model, trainer.device.type == "cuda")
    fast, ref = out[True], out[False]
    return {
        "choice_agreement": float((fast.choice == ref.choice).float().mean()),
        "max_logit_diff": float((fast.logits - ref.logits).abs().max()),
        "max_hidden_diff": float((fast.hidden - ref.hidden).abs().max()),
    }


def profile(trainer: Trainer, rows, steps: int, top: int) -> dict:
    """The heaviest kernels (device microseconds per step) and kernel launches per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            trainer.train_step(rows)
        synchronize(trainer.device)
    kernels: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type.name == "CUDA":
            kernels.setdefault(event.name, []).append(event.device_time)
    total = sum(sum(v) for v in kernels.values())
    heaviest = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "kernels_per_step": sum(len(v) for v in kernels.values()) / steps,
        "device_us_per_step": total / steps,
        "top": [
            {"name": name[:90], "us_per_step": sum(v) / steps, "calls_per_step": len(v) / steps}
            for name, v in heaviest
        ],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--algorithms", default="eagle3,mtp,eagle")
    parser.add_argument("--shapes", default="16x1024")
    parser.add_argument("--prompt-frac", type=float, default=0.3)
    parser.add_argument("--prompt-spread", type=float, default=0.0)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--profile-steps", type=int, default=0)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument(
        "--check-target",
        action="store_true",
        help="compare the target's Triton path with its torch references first",
    )
    parser.add_argument(
        "--losses",
        default="fused",
        help="soft cross-entropy variants to time on the same rows, comma-"
        "separated: fused (Triton kernels on a GPU), reference (torch)",
    )
    parser.add_argument(
        "--windows",
        default="on",
        help="later unrolled steps over the response window (on) or every "
        "position (off), comma-separated",
    )
    parser.add_argument("--output", default="")
    args = parser.parse_args(argv)
    for option, known in (("losses", {"fused", "reference"}), ("windows", {"on", "off"})):
        unknown = set(getattr(args, option).split(",")) - known
        if unknown:
            parser.error(
                f"--{option}: unknown {', '.join(sorted(unknown))} ({', '.join(sorted(known))})"
            )
    if not 0 <= args.prompt_spread <= min(args.prompt_frac, 1 - args.prompt_frac):
        parser.error("--prompt-spread must keep every prompt fraction within [0, 1]")
    results = []
    disagree = []
    with tempfile.TemporaryDirectory() as work:
        for algorithm in args.algorithms.split(","):
            for shape in args.shapes.split(","):
                began = time.perf_counter()
                variants = measure(args, algorithm, shape, work)
                results += variants
                losses = [r["total_loss"] for r in variants]
                if max(losses) - min(losses) > 1e-3 * max(abs(x) for x in losses):
                    disagree.append(f"{algorithm} {shape}: {losses}")
                if variants[0]["target_check"]:
                    print(f"  target, Triton against references: {variants[0]['target_check']}")
                for r in variants:
                    print(
                        f"{algorithm:7s} {shape:>8s} {r['loss']:9s} window {r['window']:3s}"
                        f"  step {r['step_ms']:7.1f} ms"
                        f"  target {r['target_ms']:6.1f} ms  "
                        f"{r['learned_tokens_per_s'] / 1e3:7.1f}k learned tok/s  loss "
                        f"{r['total_loss']:.5f}  ({time.perf_counter() - began:.0f} s)",
                        flush=True,
                    )
                    if "profile" in r:
                        p = r["profile"]
                        print(
                            f"  {p['kernels_per_step']:.0f} kernels per step, "
                            f"{p['device_us_per_step'] / 1e3:.1f} ms of kernels per step"
                        )
                        for k in p["top"]:
                            print(
                                f"  {k['us_per_step'] / 1e3:8.2f} ms "
                                f"{k['calls_per_step']:6.1f}x  {k['name']}"
                            )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    if disagree:
        print("the variants gave different losses on the same rows:", *disagree, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
