"""Per-call time of the small-batch projection kernels against the library GEMM (F.linear),
over launch shapes, at the decoder projections of the SmolLM2-135M and Llama-3.1-8B shapes.

Each measurement replays a CUDA graph of CALLS back-to-back calls (as a decode graph does), so
a figure is the kernel's time plus the gap between graph nodes. Every configuration is first
checked against the reference.

  python benchmarks/bench_small_m_linear.py --rows 1,4 --output sml.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import graph_timing  # noqa: E402
from gpu_worker.kernels import small_m_linear as sml  # noqa: E402

CALLS = 50
SHAPES = {  # name: (N, K)
    "135m.qkv": (960, 576), "135m.o": (576, 576), "135m.gate_up": (3072, 576),
    "135m.down": (576, 1536), "8b.qkv": (6144, 4096), "8b.o": (4096, 4096),
    "8b.gate_up": (28672, 4096), "8b.down": (4096, 14336),
}  # fmt: skip


def time_graph(fn) -> float:
    """Microseconds per call of fn, replayed CALLS times in one CUDA graph."""
    return graph_timing.time_graph(fn, CALLS)


def configs():
    for block_n, block_k, warps in itertools.product((4, 8, 16), (128, 256, 512), (4, 8)):
        yield sml.Config(block_n, block_k, warps)


def time_prologues(name: str, n: int, k: int, args) -> list[dict]:
    """The fused kernel a decoder layer runs at this projection (residual add + RMSNorm before
    qkv and gate_up, SiLU-and-mul before down) against the unfused kernels it replaces."""
    from gpu_worker.kernels.activation import silu_and_mul
    from gpu_worker.kernels.norm import add_rms_norm

    out = []
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    for rows in (int(r) for r in args.rows.split(",")):
        if name.endswith((".qkv", ".gate_up")):
            x, res, nw = (torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _ in "xrn")
            nw = nw[0]
            c = sml.choose_config(1, n, k) or sml.Config(8, 512, 4)  # the kernel, always
            fused = lambda: sml.rms_norm_linear(x, res, nw, 1e-5, w, config=c)  # noqa: E731, B023 (used in this iteration)
            unfused = lambda: F.linear(add_rms_norm(x, res, nw, 1e-5)[0], w)  # noqa: E731, B023 (used in this iteration)
        elif name.endswith(".down"):
            gu = torch.randn(rows, 2 * k, device="cuda", dtype=torch.bfloat16)
            c = sml.choose_config(1, n, k) or sml.Config(8, 512, 4)  # the kernel, always
            fused = lambda: sml.silu_mul_linear(gu, w, config=c)  # noqa: E731, B023 (used in this iteration)
            unfused = lambda: F.linear(silu_and_mul(gu), w)  # noqa: E731, B023 (used in this iteration)
        else:
            continue
        f_us, u_us = time_graph(fused), time_graph(unfused)
        print(f"{name:<13} rows {rows:>2}: fused {f_us:6.2f} us, unfused {u_us:6.2f} us",
              flush=True)  # fmt: skip
        out.append({"shape": name, "rows": rows, "fused_us": f_us, "unfused_us": u_us})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,4")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--output")
    p.add_argument("--prologues-only", action="store_true", help="skip the sweep")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        if args.prologues_only:
            results += time_prologues(name, n, k, args)
            continue
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            library = time_graph(lambda x=x, w=w: F.linear(x, w))
            timed = []
            for c in configs():
                if c.block_n * c.block_k * rows > 32768:
                    continue  # too many registers
                try:
                    out = sml.linear(x, w, config=c)
                    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)
                    call = lambda x=x, w=w, c=c: sml.linear(x, w, config=c)  # noqa: E731
                    timed.append((time_graph(call), c))
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    print(f"  {name} rows {rows} {c}: {type(e).__name__}", flush=True)
            timed.sort(key=lambda t: t[0])
            chosen = sml.choose_config(rows, n, k)
            chosen_us = next((t for t, c in timed if c == chosen), None)
            best_us, best = timed[0]
            print(f"{name:<13} rows {rows:>2}: library {library:6.2f} us, best {best_us:6.2f} us "
                  f"{best}, chosen {chosen_us} us", flush=True)  # fmt: skip
            results.append({"shape": name, "rows": rows, "n": n, "k": k, "library_us": library,
                            "best_us": best_us, "best": best.__dict__, "chosen_us": chosen_us,
                            "top5": [(t, c.__dict__) for t, c in timed[:5]]})  # fmt: skip
        results += time_prologues(name, n, k, args)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
