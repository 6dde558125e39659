"""Per-call time of a tensor-parallel all-reduce on one machine's GPUs: NCCL against the peer
all-reduce (`gpu_worker.peer_reduce`) one-shot and two-shot, over message sizes, replayed in
CUDA graphs as a decode step runs them. Each result is first checked against NCCL's.

  python benchmarks/bench_all_reduce.py --world 2 --output all_reduce.json

The 8B shape's decode messages are rows x 4096 bf16: 8 KiB a row (1 row: 8 KiB, 64: 512 KiB).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import graph_timing  # noqa: E402

CALLS = 50
DEFAULT_SIZES_KIB = "8,16,32,64,128,256,512,1024,2048,4096,8192"


def time_variants(rank: int, world: int, address: str, args) -> list[dict]:
    from gpu_worker.parallel import init_tensor_parallel
    from gpu_worker.peer_reduce import Limits, open_peers

    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    tp = init_tensor_parallel(rank, world, address, device, peer_all_reduce=False)
    limits = [Limits(max_bytes=max(args.sizes_kib) << 10, programs=p) for p in args.programs]
    peers = {
        limit.programs: open_peers(rank, world, device, tp.gather_objects, limit)
        for limit in limits
    }
    variants = {
        f"{name}_p{programs}": (one_shot, peer)
        for programs, peer in peers.items()
        for name, one_shot in (("one_shot", True), ("two_shot", False))
    }
    rows = []
    for kib in args.sizes_kib:
        x = torch.randn(kib * 512, device=device).to(torch.bfloat16)
        expected = x.clone()
        dist.all_reduce(expected, group=tp.group)
        for name, (one_shot, peer) in variants.items():
            got = peer.all_reduce(x.clone(), one_shot)
            # two ranks: the same sum; more: NCCL adds in another order
            if world == 2 and not torch.equal(got, expected):
                raise AssertionError(f"{name} at {kib} KiB differs from NCCL")
            torch.testing.assert_close(got, expected, atol=0.1, rtol=0.05)
        row = {"kib": kib}
        row["nccl_us"] = graph_timing.time_graph(
            lambda x=x: dist.all_reduce(x, group=tp.group), CALLS
        )
        for name, (one_shot, peer) in variants.items():
            row[f"{name}_us"] = graph_timing.time_graph(
                lambda o=one_shot, p=peer, x=x: p.all_reduce(x, o), CALLS
            )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--world", type=int, default=2, help="ranks, one GPU each (default: 2)")
    p.add_argument(
        "--sizes-kib",
        default=DEFAULT_SIZES_KIB,
        help="message sizes, KiB of bf16 (default: %(default)s)",
    )
    p.add_argument(
        "--programs", default="32", help="peer kernels' grids to compare, comma list (default: 32)"
    )
    p.add_argument("--output", default="", help="JSON of every timing (default: none)")
    args = p.parse_args(argv)
    args.sizes_kib = [int(s) for s in args.sizes_kib.split(",")]
    args.programs = [int(s) for s in args.programs.split(",")]
    if torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs that many GPUs; {torch.cuda.device_count()} here")
    from gpu_worker.tooling.ranks import RankFailure, run_ranks

    try:
        rows = run_ranks(time_variants, args.world, args, timeout_s=600)[0]
    except RankFailure as e:
        sys.exit(str(e))
    columns = [k for k in rows[0] if k.endswith("_us")]
    print(f"all-reduce, {args.world} GPUs, bf16, us per call in a CUDA graph (rank 0)")
    print(" ".join(f"{c.removesuffix('_us'):>14}" for c in ["KiB", *columns]))
    for row in rows:
        print(f"{row['kib']:>14}" + "".join(f" {row[c]:>14.1f}" for c in columns))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"world": args.world, "calls": CALLS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
