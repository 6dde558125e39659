"""`python3 -m benchmarks train`: the shipped drafts' steps (docs/drafts.md) on the lent GPU
machine: generate the target's answers, train each draft, estimate it on MT-bench.

The work spans calls chained on one warm machine: each copies what it carries into --work and
runs what the files there allow (generation, MT-bench answers, training, which resumes from its
checkpoint). Each trained draft comes back as draft_ALGO.tar.* in 15 MB pieces (cat, untar).
"""

from __future__ import annotations

import argparse
import functools
import glob
import os
import re
import shlex
import shutil

from aerie.default_model import default_model_dir
from benchmarks.model_suites import DEVICE_GGUF, HALVES, real_model_steps
from benchmarks.runner import PYTHON, Call, Command, Step, SuiteError
from benchmarks.suites import SMOLLM2_SHAPE, Suite, name_list, word

# Estimate depth: the chain length each draft serves (MTP 0: as many as its layers).
ESTIMATE_DEPTH = {"eagle3": 5, "eagle": 3, "mtp": 0}
ALGORITHM = re.compile(r"(eagle3|eagle|mtp)(:\d+(\.\d+)?)?")


def algorithm_list(text: str) -> list[str]:
    items = name_list(text)
    bad = [item for item in items if not ALGORITHM.fullmatch(item)]
    if bad:
        raise argparse.ArgumentTypeError(f"expected ALGO or ALGO:MINUTES items, got {bad}")
    return items


def train_args(text: str) -> str:
    if text.partition("=")[0] not in ESTIMATE_DEPTH:
        raise argparse.ArgumentTypeError(f"expected ALGO=ARGS (eagle3, eagle, mtp), got {text!r}")
    return text


def add_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=default_model_dir(), help="the real default model")
    p.add_argument("--gguf", default=DEVICE_GGUF, help="converted into --model when missing")
    p.add_argument("--work", default="~/train", help="token files, runs and drafts")
    p.add_argument(
        "--algorithms",
        type=algorithm_list,
        default="",
        help="drafts to train: eagle3, eagle, mtp, each optionally :MINUTES (else --max-minutes)",
    )
    p.add_argument(
        "--max-minutes", type=float, default=9.0, help="training time per algorithm this call"
    )
    p.add_argument(
        "--train-args",
        type=train_args,
        action="append",
        default=[],
        metavar="ALGO=ARGS",
        help="more arguments of one algorithm's training (repeatable), e.g. 'eagle3=--depth 6'",
    )
    p.add_argument(
        "--generate-minutes",
        type=float,
        default=0.0,
        help="answer every prompts_?.npz into data.npz first, for at most this long (0: no)",
    )
    p.add_argument("--generate-batch-size", type=int, default=256, help="answers at a time")
    p.add_argument("--max-new-tokens", type=int, default=768, help="per generated answer")
    p.add_argument("--sampled-per-prompt", type=int, default=1, help="sampled answers too")
    p.add_argument("--seed", type=int, default=0, help="of the sampled answers")
    p.add_argument(
        "--estimate-new-tokens", type=int, default=512, help="per greedy MT-bench answer"
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="first generation and a few training steps on random weights of --shape "
        "(needs prompts_a.npz)",
    )
    p.add_argument("--shape", default=SMOLLM2_SHAPE, help="the model shape of --smoke")
    p.add_argument("--smoke-steps", type=int, default=40, help="training steps of --smoke")
    p.add_argument(
        "--smoke-algorithms", type=name_list, default="eagle3,eagle,mtp", help="comma list"
    )


def training(*args: object) -> list[str]:
    return [PYTHON, "-m", "training", *map(word, args)]


def copy_files(paths: list[str], directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    for path in paths:
        shutil.copyfile(path, os.path.join(directory, os.path.basename(path)))


def plan_train(args: argparse.Namespace) -> list[Step]:
    work, model = os.path.expanduser(args.work), os.path.expanduser(args.model)
    carried = sorted(glob.glob(os.path.join(args.carry_dir, "train_[a-z]", "*")))
    have = set(os.listdir(work)) if os.path.isdir(work) else set()
    steps: list[Step] = []
    if carried:
        copy = functools.partial(copy_files, carried, work)
        steps.append(Call(f"copy {len(carried)} carried files into {work}", copy))
        have |= {os.path.basename(path) for path in carried}
    if args.smoke:
        steps += smoke_steps(args, work, have)
    convert = real_model_steps(model, args.gguf)
    steps += convert
    if not convert and not os.path.isfile(os.path.join(model, "config.json")):
        steps.append(Call("the model is not assembled yet: staged for a later call", lambda: None))
        return steps
    steps += generate_steps(args, work, model, have)
    data = data_files(work, have)
    for item in args.algorithms:
        algo, _, minutes = item.partition(":")
        if not data:
            raise SuiteError(
                f"training needs data.npz or data_?.npz in {work}: carry them "
                "(.device-carry/train_?/) or pass --generate-minutes with prompts_?.npz"
            )
        steps += train_steps(args, algo, float(minutes or args.max_minutes), work, model, have)
    return steps


def data_files(work: str, have: set[str]) -> str:
    """data.npz, else the carried halves (data_a.npz, data_b.npz, ...) joined by commas."""
    if "data.npz" in have:
        return os.path.join(work, "data.npz")
    halves = sorted(f for f in have if re.fullmatch(r"data_[a-z]\.npz", f))
    return ",".join(os.path.join(work, f) for f in halves)


def smoke_steps(args: argparse.Namespace, work: str, have: set[str]) -> list[Step]:
    if "prompts_a.npz" not in have:
        raise SuiteError(f"--smoke needs prompts_a.npz in {work} (carry .device-carry/train_a)")
    smoke = os.path.join(work, "smoke.npz")
    dummy = ("--model", args.shape, "--load-format", "dummy")
    argv = training("generate", *dummy, "--prompts", os.path.join(work, "prompts_a.npz"))
    argv += ["--out", smoke, "--max-minutes", "1", "--batch-size", str(args.generate_batch_size)]
    steps: list[Step] = [
        Command(argv + ["--max-new-tokens", str(args.max_new_tokens)], "smoke_generate.log")
    ]
    for algo in args.smoke_algorithms:
        out = os.path.join(work, f"smoke_{algo}")
        argv = training("train", algo, *dummy, "--data", smoke, "--out", out)
        argv += ["--max-steps", str(args.smoke_steps), "--log-every", "10"]
        steps.append(Command(argv, f"smoke_train_{algo}.log"))
    return steps


def generate_steps(args: argparse.Namespace, work: str, model: str, have: set[str]) -> list[Step]:
    steps: list[Step] = []
    prompts = sorted(f for f in have if re.fullmatch(r"prompts_[a-z]\.npz", f))
    if args.generate_minutes and not data_files(work, have):
        if not prompts:
            raise SuiteError(f"--generate-minutes: no prompts_?.npz in {work} (carry train_a)")
        argv = training(
            *("generate", "--model", model, "--out", os.path.join(work, "data.npz")),
            *("--prompts", ",".join(os.path.join(work, f) for f in prompts)),
            *("--max-minutes", args.generate_minutes, "--batch-size", args.generate_batch_size),
            *("--max-new-tokens", args.max_new_tokens, "--seed", args.seed),
            *("--sampled-per-prompt", args.sampled_per_prompt),
        )
        steps.append(Command(argv, "generate.log"))
        have.add("data.npz")
    if "mtbench.npz" in have and "mtbench_answers.npz" not in have:
        # The target's greedy answers to MT-bench's first turns: what each estimate walks.
        argv = training(
            *("generate", "--model", model, "--prompts", os.path.join(work, "mtbench.npz")),
            *("--out", os.path.join(work, "mtbench_answers.npz"), "--batch-size", 80),
            *("--max-new-tokens", args.estimate_new_tokens, "--sampled-per-prompt", 0),
        )
        steps.append(Command(argv, "mtbench_answers.log"))
        have.add("mtbench_answers.npz")
    return steps


def train_steps(
    args: argparse.Namespace, algo: str, minutes: float, work: str, model: str, have: set[str]
) -> list[Step]:
    extra = [a.partition("=")[2] for a in args.train_args if a.partition("=")[0] == algo]
    run = os.path.join(work, algo)
    argv = training("train", algo, "--model", model, "--data", data_files(work, have))
    argv += ["--out", run, "--max-minutes", word(minutes), "--resume"]
    argv += [token for text in extra for token in shlex.split(text)]
    pieces = os.path.join(args.out, f"draft_{algo}.tar.")
    pack = f"tar cf - -C {shlex.quote(run)} draft train_log.jsonl"
    pack += f" | split -b 15M - {shlex.quote(pieces)}"
    steps: list[Step] = [
        Command(argv, f"train_{algo}.log"),
        Command(["bash", "-c", pack], f"pack_{algo}.log"),
    ]
    if "mtbench_answers.npz" in have:
        answers = os.path.join(work, "mtbench_answers.npz")
        argv = training("estimate", algo, "--model", model, "--draft", os.path.join(run, "draft"))
        argv += ["--data", answers, "--depth", str(ESTIMATE_DEPTH[algo])]
        steps.append(Command(argv, f"estimate_{algo}.log"))
    return steps


SUITE = Suite(
    "train",
    "train the drafts: generate, train, estimate",
    add_train,
    plan_train,
    ("wheels", HALVES, "train_a, train_b, ... (token files)"),
    about=__doc__.split("\n\n", 1)[1],
)
