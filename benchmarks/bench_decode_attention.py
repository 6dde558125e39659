"""Per-launch time of the fused decode attention kernel over its tuning knobs (min_keys_per_split,
block_n, warps) at the 135M and 8B attention shapes; `--queries N` times the few-query kernel.

Each figure replays a CUDA graph of CALLS back-to-back launches, so it includes the gap between
graph nodes; every configuration's output is first checked against the default's.

  python benchmarks/bench_decode_attention.py --output decode_attention.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import graph_timing  # noqa: E402
from gpu_worker.kernels import decode_attention as da  # noqa: E402
from gpu_worker.kernels import few_query_attention as fq  # noqa: E402
from gpu_worker.layers.rotary import RotaryEmbedding  # noqa: E402

CALLS = 30
SHAPES = {"135m": (9, 3, 64), "8b": (32, 8, 128)}  # heads, KV heads, head dim


def time_graph(fn) -> float:
    """Microseconds per call of fn, replayed CALLS times in one CUDA graph."""
    return graph_timing.time_graph(fn, CALLS)


class Case:
    """A batch of bs requests of seq_len keys each (the last one the new token), their pages
    shuffled over the pool, at one attention shape."""

    def __init__(
        self, shape: str, bs: int, seq_len: int, num_sms: int, queries: int = 1, tree: bool = False
    ):
        heads, kv_heads, head_dim = SHAPES[shape]
        self.heads, self.queries = heads, queries
        dev, dtype = "cuda", torch.bfloat16
        gen = torch.Generator(device=dev).manual_seed(bs * 7919 + seq_len)
        slots = bs * seq_len + 1
        self.k = torch.randn(slots, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        self.v = torch.randn(slots, kv_heads, head_dim, device=dev, generator=gen).to(dtype)
        order = torch.randperm(slots - 1, device=dev, generator=gen) + 1  # slot 0 reserved
        self.req_to_token = order.view(bs, seq_len).to(torch.int32)
        self.rows = torch.arange(bs, device=dev)
        self.seq_lens = torch.full((bs,), seq_len, device=dev, dtype=torch.int32)
        # the new tokens: each request's last `queries` keys
        new = torch.arange(seq_len - queries, seq_len, device=dev)
        self.positions = new.repeat(bs)
        self.loc = self.req_to_token[:, -queries:].flatten().to(torch.int64)
        width = (heads + 2 * kv_heads) * head_dim
        self.qkv = torch.randn(bs * queries, width, device=dev, generator=gen).to(dtype)
        self.mask = None
        if tree:  # node k's parent is a random earlier node; a node sees its ancestors
            parents = [-1] + [int(torch.randint(k, (1,))) for k in range(1, queries)]
            mask = torch.zeros(queries, queries, dtype=torch.bool)
            for k in range(queries):
                node = k
                while node != -1:
                    mask[k, node], node = True, parents[node]
            self.mask = mask.to(dev)[None].expand(bs, -1, -1).contiguous()
        self.cache = RotaryEmbedding(head_dim, 10000.0).build_cos_sin_cache(seq_len + 1, dev)
        self.scale = head_dim**-0.5
        self.splits = da.choose_num_splits(bs, kv_heads, num_sms)
        self.scratch = da.DecodeScratch.allocate(
            bs, heads * queries, kv_heads, head_dim, num_sms, dev
        )

    def run(self, min_keys: int | None, block_n: int | None, warps: int | None) -> torch.Tensor:
        if self.queries > 1:
            knobs = None
            if block_n is not None:
                knobs = fq.Knobs(block_n, min_keys, warps)
            new = fq.NewTokens(self.positions, self.loc, self.cache)
            return fq.few_query_attend(
                self.qkv,
                self.heads,
                new,
                self.k,
                self.v,
                self.req_to_token,
                self.rows,
                self.seq_lens,
                self.queries,
                self.scale,
                self.splits,
                self.scratch,
                self.mask,
                knobs,
            )
        return da.decode_attention(
            self.qkv,
            self.positions,
            self.cache,
            self.k,
            self.v,
            self.loc,
            self.req_to_token,
            self.rows,
            self.seq_lens,
            self.heads,
            self.scale,
            self.splits,
            self.scratch,
            min_keys_per_split=min_keys,
            block_n=block_n,
            num_warps=warps,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="135m,8b")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--seq-lens", default="160,512,2048,8192")
    parser.add_argument("--min-keys", default="64,256,1024")
    parser.add_argument("--block-n", default="64")
    parser.add_argument("--warps", default="2,4")
    parser.add_argument(
        "--queries",
        type=int,
        default=1,
        help="new tokens per request; above 1 the few-query kernel",
    )
    parser.add_argument("--tree", action="store_true", help="--queries: a tree-local mask")
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for shape, bs, seq_len in itertools.product(
        args.shapes.split(","), ints(args.batch_sizes), ints(args.seq_lens)
    ):
        case = Case(shape, bs, seq_len, num_sms, args.queries, args.tree)
        want = case.run(None, None, None).float()  # the defaults
        default_us = time_graph(lambda: case.run(None, None, None))  # noqa: B023
        rows.append(
            {
                "shape": shape,
                "queries": args.queries,
                "tree": args.tree,
                "bs": bs,
                "seq_len": seq_len,
                "splits": case.splits,
                "default": True,
                "us": round(default_us, 2),
            }
        )
        line = [f"default:{default_us:.1f}"]
        knobs = itertools.product(ints(args.min_keys), ints(args.block_n), ints(args.warps))
        for min_keys, block_n, warps in knobs:
            got = case.run(min_keys, block_n, warps).float()
            err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
            us = time_graph(lambda: case.run(min_keys, block_n, warps))  # noqa: B023 (used in this iteration)
            rows.append(
                {
                    "shape": shape,
                    "queries": args.queries,
                    "tree": args.tree,
                    "bs": bs,
                    "seq_len": seq_len,
                    "splits": case.splits,
                    "min_keys": min_keys,
                    "block_n": block_n,
                    "warps": warps,
                    "us": round(us, 2),
                    "rel_err": err,
                }
            )
            if err > 2e-2:
                raise SystemExit(f"{rows[-1]}: differs from the default configuration")
            line.append(f"{min_keys}/{block_n}/{warps}:{us:.1f}")
        best = min(rows[-(len(line) - 1) :], key=lambda r: r["us"])
        print(
            f"{shape} bs={bs} seq={seq_len} splits={case.splits} best (min keys/block n/warps) "
            f"{best['min_keys']}/{best['block_n']}/{best['warps']} {best['us']} us | "
            + " ".join(line),
            flush=True,
        )
    if args.output:
        with open(args.output, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(0),
                    "calls": CALLS,
                    "command": " ".join(sys.argv),
                    "rows": rows,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
