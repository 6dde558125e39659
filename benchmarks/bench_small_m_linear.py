"""Per-call time of the small-batch projection kernels against the library GEMM (F.linear), over
launch shapes, at the decoder projections of the 135M and 8B shapes. Calls replay in a CUDA
graph and cycle through copies of the weight so each reads device memory, not L2.

  python benchmarks/bench_small_m_linear.py --rows 1 --output sml.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import graph_timing  # noqa: E402
from gpu_worker.kernels import pdl  # noqa: E402
from gpu_worker.kernels import small_m_linear as sml  # noqa: E402

CALLS = 50
SHAPES = {  # name: (N, K)
    "135m.qkv": (960, 576),
    "135m.o": (576, 576),
    "135m.gate_up": (3072, 576),
    "135m.down": (576, 1536),
    "8b.qkv": (6144, 4096),
    "8b.o": (4096, 4096),
    "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336),
}


def time_graph(fn) -> float:
    """Microseconds per call of fn, replayed CALLS times in one CUDA graph."""
    return graph_timing.time_graph(fn, CALLS)


def weights(n: int, k: int, rotate_mb: int) -> list[torch.Tensor]:
    """Copies of one random weight, enough that cycling through them misses the L2 cache."""
    copies = max(1, min(CALLS, -(-rotate_mb * 2**20 // (n * k * 2))))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    return [w] + [w.clone() for _ in range(copies - 1)]


def cycling(ws: list[torch.Tensor], call):
    """fn() that calls call(w) with the next weight of ws each time."""
    turn = itertools.count()
    return lambda: call(ws[next(turn) % len(ws)])


def configs(n: int, k: int):
    small = n * k <= sml.MAX_FUSED_WEIGHT
    blocks_k = (128, 256, 512) if small else (1024, 2048, 4096)
    blocks_n = (4, 8, 16) if small else (2, 4, 8, 16)
    for block_n, block_k, warps in itertools.product(blocks_n, blocks_k, (4, 8)):
        yield sml.Config(block_n, block_k, warps)


def time_prologues(name: str, n: int, k: int, args, gemv: sml.Config | None) -> list[dict]:
    """The kernel with the step before the projection fused as its prologue (residual add +
    RMSNorm before qkv and gate_up, SiLU-and-mul before down), against the separate Triton
    kernel followed by the kernel alone at `gemv` (the best plain launch shape of this weight,
    None: skipped) or by the library GEMM. The fused kernel is timed with and without PDL
    (`--pdl`) at the chosen launch shape and at each of `--fused-block-k`."""
    from gpu_worker.kernels.activation import silu_and_mul
    from gpu_worker.kernels.norm import add_rms_norm

    out = []
    pdl_rows = pdl.MAX_ROWS
    ws = weights(n, k, args.rotate_mb)
    for rows in (int(r) for r in args.rows.split(",")):
        chosen = sml.choose_config(rows, n, k, prologue=True) or gemv or sml.Config(8, 512, 4)
        shapes = [chosen] + [
            dataclasses.replace(chosen, block_k=int(b)) for b in args.fused_block_k.split(",") if b
        ]
        for spec in filter(None, args.fused_configs.split(";")):
            block_m, block_n, warps = (int(v) for v in spec.split(","))
            if block_m <= rows:
                shapes.append(
                    dataclasses.replace(chosen, block_m=block_m, block_n=block_n, num_warps=warps)
                )
        if name.endswith((".qkv", ".gate_up")):
            x, res, nw = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in "xrn")
            nw = nw[0]
            fused = lambda w, c: sml.rms_norm_linear(x, res, nw, 1e-5, w, config=c)  # noqa: E731, B023 (used in this iteration)
            before = lambda: add_rms_norm(x, res, nw, 1e-5)[0]  # noqa: E731, B023 (used in this iteration)
        elif name.endswith(".o"):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            fused = lambda w, c: sml.linear(x, w, config=c)  # noqa: E731, B023 (used in this iteration)
            before = lambda: x  # noqa: E731, B023 (used in this iteration)
        elif name.endswith(".down"):
            gu = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
            fused = lambda w, c: sml.silu_mul_linear(gu, w, config=c)  # noqa: E731, B023 (used in this iteration)
            before = lambda: silu_and_mul(gu)  # noqa: E731, B023 (used in this iteration)
        else:
            continue
        for pdl_on in (v == "on" for v in args.pdl.split(",")):
            pdl.FORCE_OFF = not pdl_on
            pdl.MAX_ROWS = max(rows, pdl_rows)  # a fused launch of these rows takes PDL
            for config in shapes:
                f_us = time_graph(cycling(ws, lambda w, c=config: fused(w, c)))  # noqa: B023 (used in this iteration)
                library_us = time_graph(cycling(ws, lambda w: F.linear(before(), w)))  # noqa: B023 (used in this iteration)
                gemv_us = None
                if gemv is not None and rows <= sml.MAX_KERNEL_ROWS:
                    separate = lambda w: sml.linear(before(), w, config=gemv)  # noqa: E731, B023 (used in this iteration)
                    gemv_us = time_graph(cycling(ws, separate))
                print(
                    f"{name:<13} rows {rows:>2} pdl {'on ' if pdl_on else 'off'}: fused "
                    f"{f_us:6.2f} us ({config}), separate + library {library_us:6.2f} us, "
                    f"separate + kernel {gemv_us} us",
                    flush=True,
                )
                out.append(
                    {
                        "shape": name,
                        "rows": rows,
                        "pdl": pdl_on,
                        "fused_us": f_us,
                        "fused_config": config.__dict__,
                        "unfused_us": library_us,
                        "separate_gemv_us": gemv_us,
                    }
                )
        pdl.FORCE_OFF, pdl.MAX_ROWS = False, pdl_rows
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4")
    p.add_argument(
        "--rotate-mb",
        type=int,
        default=256,
        help="weight copies the calls cycle through, MB in all",
    )
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--output")
    p.add_argument("--prologues-only", action="store_true", help="skip the sweep")
    p.add_argument("--pdl", default="on,off", help="fused kernels with PDL on, off or both")
    p.add_argument(
        "--fused-configs",
        default="",
        help="BLOCK_M,BLOCK_N,WARPS;...: fused kernels also timed at these launch "
        "shapes (rows per program, columns per program, warps)",
    )
    p.add_argument(
        "--fused-block-k", default="", help="comma list: fused kernels also timed at these widths"
    )
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        if args.prologues_only:
            results += time_prologues(name, n, k, args, sml.choose_config(1, n, k))
            continue
        ws = weights(n, k, args.rotate_mb)
        best_plain = None
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, ws[0])
            library = time_graph(cycling(ws, lambda w, x=x: F.linear(x, w)))
            timed = []
            for c in configs(n, k):
                if c.block_n * c.block_k * rows > 32768:
                    continue  # too many registers
                try:
                    out = sml.linear(x, ws[0], config=c)
                    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
                    call = cycling(ws, lambda w, x=x, c=c: sml.linear(x, w, config=c))
                    timed.append((time_graph(call), c))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {name} rows {rows} {c}: {type(e).__name__}", flush=True)
            timed.sort(key=lambda t: t[0])
            chosen = sml.choose_config(rows, n, k)
            chosen_us = next((t for t, c in timed if c == chosen), None)
            best_us, best = timed[0]
            best_plain = best_plain or best
            gbps = lambda us, b=n * k * 2: b / us / 1e3  # noqa: E731
            print(
                f"{name:<13} rows {rows:>2}: library {library:6.2f} us ({gbps(library):.0f} "
                f"GB/s), best {best_us:6.2f} us ({gbps(best_us):.0f} GB/s) {best}, chosen "
                f"{chosen_us} us",
                flush=True,
            )
            results.append(
                {
                    "shape": name,
                    "rows": rows,
                    "n": n,
                    "k": k,
                    "library_us": library,
                    "best_us": best_us,
                    "best": best.__dict__,
                    "chosen_us": chosen_us,
                    "weight_copies": len(ws),
                    "top5": [(t, c.__dict__) for t, c in timed[:5]],
                }
            )
        results += time_prologues(name, n, k, args, best_plain)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
