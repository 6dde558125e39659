"""Batch-1 decode speed with and without speculative decoding, on MT-bench prompts.

    python benchmarks/bench_speculative.py --model-path DIR [--load-format dummy]
        [--algorithm EAGLE] [--draft-path DIR] [--steps 3 --topk 1 --num-draft 4 ...]

The engine runs in process (the real `Scheduler` core driving the real `GPUWorker`, no sockets),
one request at a time: first plain decoding, then each speculative shape given by --shapes
(e.g. "3,1,4 5,4,8" = S,topk,ND). For each it reports decode tokens/s (tokens after the first,
over the time after prefill), the accept length (tokens per verify step, bonus included) and
the speedup over plain decoding in the same run. Without --draft-path a draft of the right
architecture with random weights is used (mechanics only: its accept length is about 1); for
MTP the target's config gets `num_nextn_predict_layers` random layers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from aerie.codec import pack_ids, unpack_ids  # noqa: E402
from aerie.config import AerieConfig  # noqa: E402
from aerie.messages import SamplingParams, TokenizedRequest  # noqa: E402
from aerie.resolve import (  # noqa: E402
    DRAFT_ARCHITECTURES,
    resolve_attention_backend,
    resolve_device,
    resolve_dtype,
)
from gpu_worker.worker import GPUWorker  # noqa: E402
from scheduler_proc.scheduler import Scheduler  # noqa: E402
from tokenizer_proc.tokenizer import Tokenizer  # noqa: E402


def write_random_draft_config(target_dir: str, algorithm: str, out_dir: str, layers: int) -> str:
    """A draft config shaped after the target (weights come from --load-format dummy): one
    EAGLE layer, or the target's config with `layers` MTP layers."""
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    if algorithm == "MTP":
        config["num_nextn_predict_layers"] = layers
    else:
        config.update(architectures=[DRAFT_ARCHITECTURES[algorithm]], num_hidden_layers=1,
                      tie_word_embeddings=False)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir


def load_prompts(path: str, tokenizer_dir: str, num: int) -> list[list[int]]:
    """The first turn of the first `num` MT-bench questions, chat-templated."""
    tokenizer = Tokenizer(tokenizer_dir)
    with open(path) as f:
        questions = [json.loads(line)["turns"][0] for line in f][:num]
    return [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in questions]


def make_config(args, shape: tuple[int, int, int] | None, draft_dir: str | None) -> AerieConfig:
    spec = {}
    if shape is not None:
        steps, topk, num_draft = shape
        spec = {"speculative_algorithm": args.algorithm, "speculative_draft_model_path": draft_dir,
                "speculative_num_steps": steps, "speculative_eagle_topk": topk,
                "speculative_num_draft_tokens": num_draft}
    return AerieConfig().replace(
        model={"model_path": args.model_path, "tokenizer_path": args.model_path,
               "device": args.device, "dtype": args.dtype, "load_format": args.load_format,
               "context_length": 4096},
        cache={"max_total_tokens": 65536},
        scheduler={"max_running_requests": 4},
        speculative=spec,
        runner={"attention_backend": resolve_attention_backend(args.attention_backend,
                                                               args.device)},
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_one(worker: GPUWorker, sched: Scheduler, prompt: list[int], max_new: int, device: str):
    """Serve one request; returns (decode tokens, decode seconds, verify steps)."""
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    sched.add_request(TokenizedRequest("bench", pack_ids(prompt), params))
    tokens, verify, decode_start = 0, 0, None
    while sched.has_work():
        plan = sched.next_plan()
        if plan.mode == "decode" and decode_start is None:
            sync(device)
            decode_start = time.perf_counter()
        result = worker.execute(plan)
        if plan.mode == "decode":
            tokens += sum(unpack_ids(result.num_tokens))
            verify += sum(unpack_ids(result.num_verify))
        sched.apply_result(plan, result)
    sync(device)
    return tokens, time.perf_counter() - (decode_start or time.perf_counter()), verify


def measure(args, prompts, shape, draft_dir) -> dict:
    config = make_config(args, shape, draft_dir)
    worker = GPUWorker(config)
    sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
    run_one(worker, sched, prompts[0], 8, args.device)  # warm-up
    tokens = seconds = verify = 0
    for prompt in prompts:
        t, s, v = run_one(worker, sched, prompt, args.max_new_tokens, args.device)
        tokens, seconds, verify = tokens + t, seconds + s, verify + v
    name = "plain"
    if shape is not None:
        name = f"{args.algorithm} S={shape[0]} topk={shape[1]} ND={shape[2]}"
    return {"mode": name, "decode_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "accept_length": tokens / verify if verify else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    parser.add_argument("--algorithm", default="EAGLE", choices=(*DRAFT_ARCHITECTURES, "MTP"))
    parser.add_argument("--draft-path", help="draft checkpoint (default: random weights)")
    parser.add_argument("--shapes", default="3,1,4 5,4,8", help="S,topk,ND triples")
    parser.add_argument("--prompts", default=os.path.join(
        os.path.dirname(__file__), "..", "..", "shared", "data", "mt_bench_questions.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention-backend", default="auto",
                        choices=("auto", "torch_native", "triton"))
    parser.add_argument("--output", help="write the results as JSON here")
    args = parser.parse_args(argv)
    args.device = resolve_device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    prompts = load_prompts(args.prompts, args.model_path, args.num_prompts)
    draft_dir = args.draft_path
    if draft_dir is None:
        if args.load_format != "dummy":
            parser.error("without --draft-path the random draft needs --load-format dummy")
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split()]
    if draft_dir is None:
        layers = max(shape[0] for shape in shapes)
        draft_dir = write_random_draft_config(
            args.model_path, args.algorithm, tempfile.mkdtemp(), layers
        )
    results = [measure(args, prompts, None, None)]
    results += [measure(args, prompts, shape, draft_dir) for shape in shapes]
    base = results[0]["tokens_per_s"]
    print(f"{len(prompts)} MT-bench prompts, batch 1, {args.max_new_tokens} new tokens, "
          f"{args.device} {args.dtype}, draft {'random' if args.draft_path is None else draft_dir}")
    print(f"{'mode':34s} {'tok/s':>9s} {'accept len':>11s} {'speedup':>8s}")
    for r in results:
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        print(f"{r['mode']:34s} {r['tokens_per_s']:9.1f} {accept:>11s} "
              f"{r['tokens_per_s'] / base:7.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"command": " ".join(sys.argv), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
