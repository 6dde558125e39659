"""Speculative decoding speed: MT-bench served at batch 1, and the cost of one iteration.

    python benchmarks/bench_speculative.py [--model-path DIR] [--shapes "3,1,4 5,4,8"]
    python benchmarks/bench_speculative.py --mode iteration --model-path DIR --load-format dummy

--mode requests (`spec_requests.py`): tokens/s, accept length and speedup over plain; --mode
iteration: an iteration's cost in plain graphed steps, random and always-agreeing drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


from aerie.config import AerieConfig  # noqa: E402
from aerie.resolve import (  # noqa: E402
    DRAFT_ARCHITECTURES,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from aerie.step_costs import StepCosts  # noqa: E402
from benchmarks.iteration_stages import stage_split  # noqa: E402
from benchmarks.iteration_timing import (  # noqa: E402
    Replayer,
    byte_bound,
    host_split,
    make_agreeing,
    profile_plan,
    spin,
    sub_plan,
    time_plan,
)
from benchmarks.spec_requests import run_requests  # noqa: E402
from gpu_worker.kernels import pdl  # noqa: E402
from gpu_worker.worker import GPUWorker  # noqa: E402

EAGLE3_DRAFT_VOCAB = 32000  # the draft vocabulary of the published Llama-3.1-8B EAGLE-3 heads


def write_random_draft_config(target_dir: str, algorithm: str, out_dir: str, layers: int) -> str:
    """A draft config shaped after the target (weights come from --load-format dummy): one
    EAGLE layer (EAGLE-3: with a draft vocabulary of at most 32,000 tokens), or the target's
    config with `layers` MTP layers."""
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    if algorithm == "MTP":
        config["num_nextn_predict_layers"] = layers
    else:
        config.update(
            architectures=[DRAFT_ARCHITECTURES[algorithm]],
            num_hidden_layers=1,
            tie_word_embeddings=False,
        )
        if algorithm == "EAGLE3":
            config["draft_vocab_size"] = min(EAGLE3_DRAFT_VOCAB, config["vocab_size"])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def load_questions(path: str, num: int, turns: int) -> list[list[str]]:
    """The first `turns` turns of the first `num` MT-bench questions (each must have one)."""
    with open(path) as f:
        questions = [json.loads(line)["turns"][:turns] for line in f if line.strip()][:num]
    if not questions or not all(questions):
        raise ValueError(f'{path}: every question needs at least one turn ("turns": [...])')
    return questions


def make_config(args, shape: tuple[int, int, int] | None, draft_dir: str | None) -> AerieConfig:
    spec = {}
    if shape is not None:
        steps, topk, num_draft = shape
        spec = {
            "speculative_algorithm": args.algorithm,
            "speculative_draft_model_path": draft_dir,
            "speculative_num_steps": steps,
            "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": num_draft,
        }
    return AerieConfig().replace(
        model={
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "device": args.device,
            "dtype": args.dtype,
            "load_format": args.load_format,
            "context_length": 4096,
        },
        cache={"max_total_tokens": 65536},
        scheduler={"max_running_requests": 4},
        speculative=spec,
        runner={
            "attention_backend": resolve_attention_backend(args.attention_backend, args.device)
        },
    )


# ------------------------------------------------------------------------------ --mode iteration


def iteration_config(args, shape, draft_dir, max_bs: int) -> AerieConfig:
    config = make_config(args, shape, draft_dir)
    return config.replace(
        scheduler={"max_running_requests": max_bs},
        runner={"attention_backend": config.runner.attention_backend, "cuda_graph_max_bs": max_bs},
    )


def measure_iterations(args, shapes, draft_dir) -> list[dict]:
    """Every timing first, then (with --profile) a second pass over fresh workers for the
    profiles: once the profiler has run, CUPTI stays attached to the process and slows every
    later launch, so a timing taken after a profile would not compare with one before it."""
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    max_bs = max(sizes)

    def replayer(shape):
        config = iteration_config(args, shape, draft_dir if shape else None, max_bs)
        worker = GPUWorker(config)
        replay = Replayer(worker, config, max_bs, args.context_len, args.temperature)
        time_plan(replay, None, args.device, args.iters)  # warm-up: every kernel compiled
        return worker, replay

    worker, replay = replayer(None)
    plain = {bs: time_plan(replay, bs, args.device, args.iters)[0] for bs in sizes}
    plain_alone = {
        bs: time_plan(replay, bs, args.device, args.iters, in_flight=1)[0] for bs in sizes
    }
    hosts = {None: {bs: host_split(replay, bs) for bs in sizes}} if args.device == "cuda" else {}
    spin(replay, sizes[0], "plain", args.spin)
    del worker, replay
    rows = []
    for shape in shapes:
        worker, replay = replayer(shape)
        bound = byte_bound(worker)
        random_draft = {bs: time_plan(replay, bs, args.device, args.iters) for bs in sizes}
        alone = {bs: time_plan(replay, bs, args.device, args.iters, in_flight=1)[0] for bs in sizes}
        if args.device == "cuda":
            hosts[shape] = {bs: host_split(replay, bs) for bs in sizes}
        stages = {
            bs: stage_split(worker, sub_plan(replay.plan, bs), replay.restore) for bs in sizes
        }
        spin(replay, sizes[0], f"S={shape[0]} topk={shape[1]} ND={shape[2]}", args.spin)
        make_agreeing(worker, max_bs)
        for bs in sizes:
            seconds, _ = random_draft[bs]
            agreed_s, agreed_tokens = time_plan(replay, bs, args.device, args.iters)
            rows.append(
                {
                    "mode": f"{args.algorithm} S={shape[0]} topk={shape[1]} ND={shape[2]}",
                    "shape": shape,
                    "batch_size": bs,
                    "plain_step_ms": plain[bs] * 1e3,
                    "iteration_ms": seconds * 1e3,
                    "ratio": seconds / plain[bs],
                    "plain_step_alone_ms": plain_alone[bs] * 1e3,
                    "iteration_alone_ms": alone[bs] * 1e3,
                    "byte_bound": bound,
                    "agreeing_iteration_ms": agreed_s * 1e3,
                    "agreeing_tokens_per_iteration": agreed_tokens / bs,
                    "agreeing_speedup": agreed_tokens / agreed_s / (bs / plain[bs]),
                    "stages": {**stages[bs], "host_ms": seconds * 1e3 - stages[bs]["stages_ms"]},
                }
            )
            if hosts:
                rows[-1].update(plain_host=hosts[None][bs], host=hosts[shape][bs])
        del worker, replay
    if args.profile:
        profiles = {}
        for shape in [None, *shapes]:
            worker, replay = replayer(shape)
            profiles[shape] = {bs: profile_plan(replay, bs) for bs in sizes}
            del worker, replay
        for row in rows:
            plain_profile, profile = (
                profiles[None][row["batch_size"]],
                profiles[row["shape"]][row["batch_size"]],
            )
            row.update(
                plain_kernels=plain_profile["kernels"],
                plain_gpu_ms=plain_profile["gpu_ms"],
                kernels=profile["kernels"],
                gpu_ms=profile["gpu_ms"],
                kernel_table=profile["table"],
                plain_kernel_table=plain_profile["table"],
                plain_timeline=plain_profile["timeline"],
                timeline=profile["timeline"],
            )
    return rows


def print_iterations(args, rows: list[dict]) -> None:
    print(
        f"iteration cost, {args.device} {args.dtype}, {args.model_path}, prompts of "
        f"{args.context_len} tokens, {args.iters} iterations each"
    )
    print(
        f"{'mode':30s} {'bs':>3s} {'plain ms':>9s} {'iter ms':>8s} {'ratio':>6s} "
        f"{'bound':>6s} {'agree acc':>9s} {'agree tok/s vs plain':>21s}"
    )
    several_limits = len({r["fused_rows"] for r in rows}) > 1
    for r in rows:
        if several_limits:
            print(f"  (fused kernel up to {r['fused_rows']} rows)")
        print(
            f"{r['mode']:30s} {r['batch_size']:3d} {r['plain_step_ms']:9.3f} "
            f"{r['iteration_ms']:8.3f} {r['ratio']:6.2f} {r['byte_bound']:6.2f} "
            f"{r['agreeing_tokens_per_iteration']:9.2f} {r['agreeing_speedup']:20.2f}x"
        )
        print(
            f"{'':34s} each step alone: plain {r['plain_step_alone_ms']:.3f} ms, iteration "
            f"{r['iteration_alone_ms']:.3f} ms"
        )
        st = r["stages"]
        print(
            f"{'':34s} stages alone: propose (draft + verify) {st['propose_ms']:.3f} ms, accept "
            f"{st['accept_ms']:.3f}, extend {st['extend_ms']:.3f}; the rest (host) "
            f"{st['host_ms']:.3f}"
        )
        for name in ("plain_host", "host"):
            if name in r:
                h = r[name]
                print(
                    f"{'':34s} {'plain' if name == 'plain_host' else 'spec':5s} host: launch "
                    f"{h['launch_us']:.0f} us (graph replay calls {h['replay_us']:.0f}), "
                    f"finish {h['finish_us']:.0f}"
                )
        if "kernels" in r:
            print(
                f"{'':34s} kernels {r['plain_kernels']:.0f} -> {r['kernels']:.0f}, GPU busy "
                f"{r['plain_gpu_ms']:.3f} -> {r['gpu_ms']:.3f} ms"
            )
            for name in ("plain_timeline", "timeline"):
                t = r.get(name)
                if t and "wall_us" in t:
                    print(
                        f"{'':34s} {name.split('_')[0] if '_' in name else 'spec':5s} wall "
                        f"{t['wall_us']:.0f} us = host {t['host_us']:.0f} + GPU span "
                        f"{t['span_us']:.0f} (busy {t['busy_us']:.0f}, {t['short_gaps']:.0f} "
                        f"short gaps {t['short_gap_us']:.0f}, {t['long_gaps']:.0f} long "
                        f"{t['long_gap_us']:.0f}), first kernel after {t['lead_us']:.0f}"
                    )
                    for g in t["longest_gaps"]:
                        print(
                            f"{'':40s} gap {g['us']:.1f} us after {g['after'][:40]} before "
                            f"{g['before'][:40]}"
                        )
            for k in r["kernel_table"][: args.profile_top]:
                print(
                    f"{'':38s} {k['count']:5.0f} x {k['us'] / max(k['count'], 1):7.1f} us  "
                    f"{k['kernel'][:70]}"
                )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the default model")
    parser.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    parser.add_argument("--algorithm", default="EAGLE3", choices=(*DRAFT_ARCHITECTURES, "MTP"))
    parser.add_argument(
        "--draft-path",
        help="draft checkpoint, or ALGO=DIR pairs separated by "
        "commas (default: the default model's shipped drafts; random weights "
        "with --load-format dummy)",
    )
    parser.add_argument(
        "--shapes",
        default="3,1,4 5,1,6 5,4,8 6,8,32",
        help="S,topk,ND triples, each optionally prefixed ALGO: (requests mode)",
    )
    parser.add_argument(
        "--prompts",
        default=os.path.join(
            os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl"
        ),
    )
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="per turn")
    parser.add_argument(
        "--turns",
        type=int,
        default=2,
        help="--mode requests: turns asked per question (MT-bench has 2; each "
        "after the run's own answers to the earlier ones)",
    )
    parser.add_argument("--temperatures", default="0", help="--mode requests: e.g. 0,0.7")
    parser.add_argument(
        "--greedy-only",
        default="",
        help="--mode requests: modes (as printed, comma-separated) run at temperature 0 only",
    )
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=8,
        help="--mode requests: the server's request rows (and graph buckets)",
    )
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--attention-backend", default="auto", choices=("auto", "torch_native", "triton")
    )
    parser.add_argument("--output", help="write the results as JSON here")
    parser.add_argument(
        "--step-costs",
        default=None,
        help="--mode requests: step costs as /server_info shows them (e.g. a GPU's): each "
        "speculative mode runs twice, speculating every step and adaptively at these costs "
        "(`... adaptive`), and every row reports the speed these costs price its plain steps "
        "and iterations at (the batch-1 bucket), against plain decoding",
    )
    parser.add_argument("--mode", default="requests", choices=("requests", "iteration"))
    parser.add_argument("--batch-sizes", default="1", help="--mode iteration: batch sizes")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="--mode iteration: the requests' temperature (above 0 a plain step "
        "samples and an iteration accepts in its accept stage; the agreeing "
        "draft's columns mean something at 0 only: its target is uniform)",
    )
    parser.add_argument(
        "--spin",
        type=float,
        default=0.0,
        help="--mode iteration: after timing plain decoding and each shape, run "
        "its first batch size this many seconds (for a host profiler)",
    )
    parser.add_argument(
        "--context-len", type=int, default=256, help="--mode iteration: prompt tokens per request"
    )
    parser.add_argument("--iters", type=int, default=50, help="--mode iteration: timed steps")
    parser.add_argument(
        "--profile-top",
        type=int,
        default=0,
        help="with --profile: print the N most expensive kernels of each row",
    )
    parser.add_argument(
        "--fused-rows",
        default="",
        help="--mode iteration: e.g. 1,4: measure every shape once per value of "
        "pdl.MAX_ROWS (rows up to which the triton backend's "
        "projections run the fused kernel, and launches take PDL)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="--mode iteration on CUDA: kernels and GPU busy time per step",
    )
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    draft_dir = args.draft_path
    shapes = [shape for _, shape in parse_shapes(args.shapes, args.algorithm)]
    if draft_dir is None and args.load_format == "dummy":
        if args.model_path is None:
            parser.error("--load-format dummy needs --model-path (a config.json to shape it)")
        layers = max(shape[0] for shape in shapes)
        draft_dir = write_random_draft_config(
            args.model_path, args.algorithm, tempfile.mkdtemp(), layers
        )
    if args.mode == "iteration":
        if draft_dir is None or args.model_path is None:
            parser.error(
                "--mode iteration needs --model-path, and --draft-path or --load-format dummy"
            )
        rows = []
        default_rows = pdl.MAX_ROWS
        limits = [int(n) for n in args.fused_rows.split(",")] if args.fused_rows else [default_rows]
        try:
            for fused_rows in limits:  # fused projections and PDL, up to that many rows
                pdl.MAX_ROWS = fused_rows
                rows += [
                    {**row, "fused_rows": fused_rows}
                    for row in measure_iterations(args, shapes, draft_dir)
                ]
        finally:
            pdl.MAX_ROWS = default_rows
        print_iterations(args, rows)
        if args.output:
            with open(args.output, "w") as f:
                json.dump({"command": " ".join(sys.argv), "results": rows}, f, indent=1)
        return
    if args.turns < 1:
        parser.error("--turns must be at least 1")
    if args.step_costs is not None:
        try:
            StepCosts.from_json(args.step_costs)
        except ValueError as error:
            parser.error(str(error))
    if "plain" in args.greedy_only.split(","):
        parser.error("--greedy-only cannot name plain: every temperature needs its baseline")
    drafts = parse_drafts(args.draft_path, args.algorithm)
    if args.load_format == "dummy":
        drafts = {args.algorithm: draft_dir}
    try:
        questions = load_questions(args.prompts, args.num_prompts, args.turns)
    except (OSError, ValueError) as error:
        parser.error(str(error))
    run_requests(args, questions, parse_shapes(args.shapes, args.algorithm), drafts)


def parse_drafts(text: str | None, algorithm: str) -> dict[str, str | None]:
    """--draft-path: one directory (for --algorithm) or ALGO=DIR pairs separated by commas."""
    if not text:
        return {}
    if "=" not in text:
        return {algorithm: text}
    return dict(pair.split("=", 1) for pair in text.split(","))


def parse_shapes(text: str, algorithm: str) -> list[tuple[str, tuple[int, int, int]]]:
    """--shapes: S,topk,ND triples, each optionally prefixed ALGO: (default --algorithm)."""
    out = []
    for item in text.split():
        name, _, triple = item.rpartition(":")
        out.append((name or algorithm, tuple(int(x) for x in triple.split(","))))
    return out  # type: ignore[return-value]


if __name__ == "__main__":
    main()
