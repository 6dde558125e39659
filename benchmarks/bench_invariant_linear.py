"""The deterministic mode's projection (`batch_invariant`) over launch shapes, at the decoder
projections of the 135M and 8B shapes with the step before each (norm, SiLU) as the server runs
it: per-call time at each row count against the default mode's entry point; for every launch
shape whether a row keeps its bits from 1 row to the largest count (a shape that does not is
reported and never chosen), and whether its rows are the bits of the chosen shape's.

  python benchmarks/bench_invariant_linear.py --rows 1,64,512 --output inv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import graph_timing  # noqa: E402
from benchmarks.bench_small_m_linear import SHAPES  # noqa: E402
from gpu_worker.kernels import activation, norm  # noqa: E402
from gpu_worker.kernels import batch_invariant as bi  # noqa: E402
from gpu_worker.kernels import small_m_linear as sml  # noqa: E402

CALLS = 50
PROLOGUE_OF = {"qkv": "add_norm", "gate_up": "add_norm", "o": "plain", "down": "silu_mul"}


def parse_shapes(text: str) -> dict[str, tuple[int, int]]:
    """'135m.qkv,tiny.down=48x40' -> {name: (N, K)}; a name's last part is its prologue."""
    out = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, _, size = item.partition("=")
        if name.rsplit(".", 1)[-1] not in PROLOGUE_OF:
            raise SystemExit(f"{name}: the name ends in one of {sorted(PROLOGUE_OF)}")
        out[name] = tuple(int(v) for v in size.split("x")) if size else SHAPES[name]
    return out


def parse_grid(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


class Inputs:
    """The inputs of one projection at `rows` rows: x (and the residual and norm weight, or
    gate and up side by side), the first rows shared by every row count."""

    def __init__(self, prologue: str, rows: int, n: int, k: int, device: str, dtype, gen):
        width = 2 * k if prologue == "silu_mul" else k
        make = lambda *s: torch.randn(*s, generator=gen).to(device, dtype)  # noqa: E731
        self.prologue = prologue
        self.x, self.res, self.norm_w = make(rows, width), make(rows, width), make(k)

    def rows(self, m: int) -> Inputs:
        view = object.__new__(Inputs)
        view.prologue, view.norm_w = self.prologue, self.norm_w
        view.x, view.res = self.x[:m], self.res[:m]
        return view

    def invariant(self, w: torch.Tensor, config) -> torch.Tensor:
        """The deterministic mode's path for this projection (the entry point's separate norm
        or SiLU kernel, then the invariant matmul) at this launch shape."""
        x = self.x
        if self.prologue == "add_norm":
            x = norm.add_rms_norm(self.x, self.res, self.norm_w, 1e-5)[0]
        elif self.prologue == "silu_mul":
            x = activation.silu_and_mul(self.x)
        return bi.linear(x, w, config=config)

    def default(self, w: torch.Tensor) -> torch.Tensor:
        """The default mode's entry point for this projection (the kernels it picks by rows)."""
        if self.prologue == "add_norm":
            return sml.rms_norm_linear(self.x, self.res, self.norm_w, 1e-5, w)[0]
        if self.prologue == "silu_mul":
            return sml.silu_mul_linear(self.x, w)
        return sml.linear(self.x, w)


def weights(n: int, k: int, rotate_mb: int, device: str, dtype) -> list[torch.Tensor]:
    """Copies of one random weight, enough that cycling through them misses the L2 cache."""
    copies = max(1, min(CALLS, -(-rotate_mb * 2**20 // (n * k * 2))))
    w = (torch.randn(n, k) * k**-0.5).to(device, dtype)
    return [w] + [w.clone() for _ in range(copies - 1)]


def timer(device: str, ws: list[torch.Tensor], call) -> float:
    """Microseconds per call(w), cycling through the weight copies: replayed in a CUDA graph
    on CUDA, else by the wall clock (CPU: a smoke run, not a figure)."""
    turn = itertools.count()
    fn = lambda: call(ws[next(turn) % len(ws)])  # noqa: E731
    if device == "cuda":
        return graph_timing.time_graph(fn, CALLS)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def sweep(name: str, n: int, k: int, args, gen) -> list[dict]:
    """Every launch shape of the grid at every row count, its row-0 bits at 1 row against
    each larger count, and the default mode's time at each count."""
    dtype = getattr(torch, args.dtype)
    prologue = PROLOGUE_OF[name.rsplit(".", 1)[-1]]
    ws = weights(n, k, args.rotate_mb, args.device, dtype)
    counts = parse_grid(args.rows)
    full = Inputs(prologue, max(counts), n, k, args.device, dtype, gen)
    chosen = bi.config_for(n, k, ws[0].element_size())
    grid = (args.block_n, args.block_k, args.warps, args.stages, args.block_m)
    shapes = [bi.Config(*c) for c in itertools.product(*(parse_grid(g) for g in grid))]
    shapes = [chosen] + [c for c in shapes if c != chosen]
    default_us = {m: timer(args.device, ws, full.rows(m).default) for m in counts}
    chosen_rows = full.invariant(ws[0], chosen)
    out = []
    for config in shapes:
        try:
            alone = full.rows(1).invariant(ws[0], config)
            views = {m: full.rows(m) for m in counts}
            times = {
                m: timer(args.device, ws, lambda w, v=v, c=config: v.invariant(w, c))
                for m, v in views.items()
            }
            same = all(
                torch.equal(full.rows(m).invariant(ws[0], config)[:1], alone) for m in counts
            )
            as_chosen = torch.equal(full.invariant(ws[0], config), chosen_rows)
        except Exception as e:  # noqa: BLE001 - a shape that does not compile or fit
            print(f"{name:<13} {config}: {type(e).__name__}: {str(e)[:80]}", flush=True)
            continue
        row = {"shape": name, "n": n, "k": k, "config": config._asdict()}
        row |= {"chosen": config == chosen, "us": times, "default_us": default_us}
        row["row_invariant"], row["same_bits_as_chosen"] = same, as_chosen
        out.append(row)
        cells = "  ".join(f"{m}: {t:7.2f} us ({t / default_us[m]:.2f}x)" for m, t in times.items())
        tag = "chosen" if config == chosen else ("" if same else "NOT INVARIANT")
        tag += "" if as_chosen else " (other bits than the chosen shape)"
        print(f"{name:<13} {tuple(config)!s:<18} {cells} {tag}", flush=True)
    ok = [r for r in out if r["row_invariant"]]
    for m in counts:
        best = min(ok, key=lambda r: r["us"][m], default=None)
        if best is not None:
            print(
                f"{name:<13} rows {m:>4}: default {default_us[m]:7.2f} us, best invariant "
                f"{best['us'][m]:7.2f} us {tuple(best['config'].values())}",
                flush=True,
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="names, or name=NxK")
    p.add_argument("--rows", default="1,64,512", help="row counts, comma list")
    p.add_argument("--block-n", default="16,32,64", help="columns per program, comma list")
    p.add_argument("--block-k", default="64,128,256", help="K per step, comma list")
    p.add_argument("--warps", default="4,8", help="comma list")
    p.add_argument("--stages", default="2,3,4", help="comma list")
    p.add_argument(
        "--block-m",
        default=str(bi.BLOCK_M),
        help="rows per tile, comma list (16: the warp MMA on SM 9.0; the server runs 64)",
    )
    p.add_argument("--rotate-mb", type=int, default=256, help="weight copies cycled, MB in all")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--output", help="write the rows as JSON here")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in parse_shapes(args.shapes).items():
        results += sweep(name, n, k, args, gen)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
