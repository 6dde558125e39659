"""The suites of `python3 -m benchmarks` that run benchmark programs on random weights one after
another: decode steps, speculative iterations, kernels, the CUDA tests, training steps. Each is
its flags (`add_*`) and its plan (`plan_*`: flags -> steps). The suites on the real default
model are in model_suites.py, those that launch servers in serving_suites.py, `train` in
train_suite.py, `prepare` in device_carry.py.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from benchmarks.host_profile import profile_spins
from benchmarks.runner import PYTHON, REPO_ROOT, Command, Step, SuiteError

SMOLLM2_SHAPE = ".device-carry/smollm2-config"
LLAMA8B_SHAPE = ".device-carry/llama8b"
SHAPE_TRIPLE = re.compile(r"([A-Z0-9]+:)?\d+,\d+,\d+")


@dataclass(frozen=True)
class Suite:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    plan: Callable[[argparse.Namespace], list[Step]]
    carries: tuple[str, ...] = ()  # what it reads from .device-carry/ on the device
    on_device: bool = True  # prints the GPU first; `prepare` runs here
    about: str = ""  # more of its --help


def int_list(text: str) -> list[int]:
    try:
        return [int(item) for item in name_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text!r}") from None


def number_list(text: str) -> list[str]:
    """Comma-separated numbers, kept as written (they end up in commands and file names)."""
    items = name_list(text)
    try:
        for item in items:
            float(item)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers: {text!r}") from None
    return items


def name_list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def spec_algorithms(text: str) -> list[str]:
    algorithms = name_list(text)
    if not algorithms or not set(algorithms) <= {"EAGLE3", "EAGLE", "MTP"}:
        raise argparse.ArgumentTypeError(f"expected EAGLE3, EAGLE or MTP, got {text!r}")
    return algorithms


def shape_list(text: str) -> str:
    """Space-separated S,topk,ND triples, each optionally ALGO: prefixed (bench_speculative)."""
    bad = [item for item in text.split() if not SHAPE_TRIPLE.fullmatch(item)]
    if bad or not text.split():
        raise argparse.ArgumentTypeError(f"expected S,topk,ND triples, got {text!r}")
    return text


def word(value: object) -> str:
    """A command-line word: 32.0 -> "32", 0.7 -> "0.7"."""
    return f"{value:g}" if isinstance(value, float) else str(value)


def bench(name: str, *args: object) -> list[str]:
    return [PYTHON, f"benchmarks/{name}.py", *map(word, args)]


def out_file(args: argparse.Namespace, name: str) -> str:
    return os.path.join(args.out, name)


def in_repo(path: str) -> str:
    """A repository-relative path made absolute, for a command run from another tree."""
    return path if os.path.isabs(path) or "/" not in path else os.path.join(REPO_ROOT, path)


def trees(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(file tag, cwd): this tree, then --baseline-tree (same run, same machine: comparable)."""
    return [("", None)] + ([("_base", args.baseline_tree)] if args.baseline_tree else [])


def add_decode(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default=SMOLLM2_SHAPE, help="comma list of model directories, or llama3-8b"
    )
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument("--batch-sizes", type=int_list, default="1,64", help="comma list")
    p.add_argument(
        "--variants",
        default="triton+graph,nopdl+graph,compiled",
        help="comma list (bench_decode.py --help)",
    )
    p.add_argument("--prompt-lens", type=int_list, default="128", help="one run per prompt length")
    p.add_argument("--decode-steps", type=int, default=64, help="timed steps per run")
    p.add_argument("--warmup-steps", type=int, default=8, help="steps before timing")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per variant")
    p.add_argument("--gemv-configs", default="", help="BN,BK,WARPS;...: more variants")
    p.add_argument("--profile-steps", type=int, default=4, help="steps profiled for kernels")
    add_timeout_and_baseline(p, 300)


def add_timeout_and_baseline(p: argparse.ArgumentParser, timeout_s: float) -> None:
    p.add_argument("--timeout-s", type=float, default=timeout_s, help="per benchmark run")
    p.add_argument(
        "--baseline-tree",
        default="",
        help="another checkout (an older commit's tree): each run again there right after, "
        "its files tagged _base",
    )


def plan_decode(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = []
    for prompt_len in args.prompt_lens:
        for tag, cwd in trees(args):
            models = ",".join(in_repo(m) if cwd else m for m in name_list(args.models))
            name = f"decode_p{prompt_len}{tag}"
            argv = bench(
                "bench_decode",
                *("--models", models, "--load-format", args.load_format),
                *("--batch-size", ",".join(map(str, args.batch_sizes))),
                *("--variants", args.variants, "--prompt-len", prompt_len),
                *("--decode-steps", args.decode_steps, "--warmup-steps", args.warmup_steps),
                *("--repeats", args.repeats, "--profile-steps", args.profile_steps),
                *(("--gemv-configs", args.gemv_configs) if args.gemv_configs else ()),
                *("--output", out_file(args, f"{name}.json")),
            )
            steps.append(Command(argv, f"{name}.txt", timeout_s=args.timeout_s, cwd=cwd))
    return steps


def add_iteration(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default=f"{SMOLLM2_SHAPE},{LLAMA8B_SHAPE}",
        help="comma list of target model directories",
    )
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument(
        "--algorithms", type=spec_algorithms, default="EAGLE3,MTP", help="EAGLE3, EAGLE, MTP"
    )
    p.add_argument(
        "--shapes",
        type=shape_list,
        default="1,1,2 3,1,4 5,1,6 5,4,8 6,8,32",
        help="S,topk,ND triples, space-separated",
    )
    p.add_argument("--mtp-shapes", type=shape_list, default="1,1,2 3,1,4", help="MTP's shapes")
    p.add_argument("--batch-sizes", type=int_list, default="1,32", help="comma list")
    p.add_argument(
        "--temperatures",
        type=number_list,
        default="0",
        help="one run per temperature; files of a temperature other than 0 end in _t<T>",
    )
    p.add_argument("--iters", type=int, default=50, help="timed steps")
    p.add_argument(
        "--draft-path",
        default="",
        help="a draft checkpoint whose config shapes the draft (e.g. the shipped "
        "aerie/drafts/SmolLM2-135M-Instruct/eagle3); default: a random one after the target",
    )
    p.add_argument("--profile", action="store_true", help="kernels and GPU busy time per step")
    p.add_argument("--profile-top", type=int, default=0, help="with --profile: top N kernels")
    p.add_argument("--fused-rows", default="", help="e.g. 1,4: every shape once per value")
    p.add_argument(
        "--pyspy-seconds",
        type=float,
        default=0,
        help="host profiles (py-spy) of plain steps and of each shape's iterations at the first "
        "batch size, this long each (at least 2; 0: none)",
    )
    add_timeout_and_baseline(p, 240)


def plan_iteration(args: argparse.Namespace) -> list[Step]:
    if 0 < args.pyspy_seconds < 2:
        raise SuiteError("--pyspy-seconds must be 0 or at least 2")
    steps: list[Step] = []
    for model in name_list(args.models):
        for algo in args.algorithms:
            for temp in args.temperatures:
                name = f"{os.path.basename(model.rstrip('/'))}_{algo}"
                name += f"_t{temp}" if float(temp) else ""
                for tag, cwd in trees(args):
                    steps.append(iteration_command(args, model, algo, temp, name + tag, cwd))
    return steps


def iteration_command(
    args: argparse.Namespace, model: str, algo: str, temp: str, name: str, cwd: str | None
) -> Command:
    shapes = args.mtp_shapes if algo == "MTP" else args.shapes
    draft = in_repo(args.draft_path) if cwd else args.draft_path
    argv = bench(
        "bench_speculative",
        *("--mode", "iteration", "--model-path", in_repo(model) if cwd else model),
        *("--load-format", args.load_format, "--algorithm", algo, "--shapes", shapes),
        *(("--draft-path", draft) if draft else ()),
        *("--batch-sizes", ",".join(map(str, args.batch_sizes)), "--iters", args.iters),
        *(("--profile", "--profile-top", args.profile_top) if args.profile else ()),
        *(("--fused-rows", args.fused_rows) if args.fused_rows else ()),
        *(("--spin", args.pyspy_seconds) if args.pyspy_seconds else ()),
        *("--temperature", temp, "--output", out_file(args, f"iter_{name}.json")),
    )
    cmd = Command(argv, f"iter_{name}.txt", timeout_s=args.timeout_s, cwd=cwd)
    if args.pyspy_seconds:
        prefix = out_file(args, f"host_profile_iter_{name}")
        cmd.during = profile_spins(out_file(args, cmd.log), args.pyspy_seconds, prefix)
        cmd.during_text = (
            f"py-spy on each spinning step, {word(args.pyspy_seconds)} s -> {prefix}_N.txt"
        )
    return cmd


def add_kernels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--benchmarks", type=name_list, default="linear,attention", help="linear, attention"
    )
    p.add_argument(
        "--linear",
        action="append",
        metavar="ARGS",
        help="the arguments of one bench_small_m_linear.py run, written with = (repeatable; "
        "none: one run with its defaults), e.g. --linear='--rows 1 --shapes 8b.down,8b.qkv'",
    )
    p.add_argument(
        "--attention",
        action="append",
        metavar="ARGS",
        help="the arguments of one bench_decode_attention.py run (as --linear)",
    )
    p.add_argument("--timeout-s", type=float, default=300, help="per benchmark run")


def plan_kernels(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = []
    for key, program, runs in (
        ("linear", "bench_small_m_linear", args.linear),
        ("attention", "bench_decode_attention", args.attention),
    ):
        if key not in args.benchmarks:
            continue
        for n, extra in enumerate(runs or [""], 1):
            name = f"{program.removeprefix('bench_')}_{n}"
            argv = bench(program, *shlex.split(extra), "--output", out_file(args, f"{name}.json"))
            steps.append(Command(argv, f"{name}.txt", timeout_s=args.timeout_s))
    return steps


CUDA_TESTS = (
    "tests/gpu_worker/speculative",
    "tests/gpu_worker/test_worker.py",
    "tests/gpu_worker/test_cuda.py",
    "tests/gpu_worker/test_cuda_graph.py",
    "tests/gpu_worker/test_prefill_graph.py",
    "tests/gpu_worker/kernels",
    "tests/gpu_worker/test_deterministic.py",
    "tests/gpu_worker/test_peer_reduce.py",  # skipped with one GPU
)
E2E_TESTS = ("tests/e2e/test_parity.py", "tests/e2e/test_speculative.py")


def add_cuda_tests(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tests", nargs="+", default=list(CUDA_TESTS), help="pytest paths")
    p.add_argument("-k", "--filter", default="", help="pytest -k expression")
    p.add_argument("--timeout-s", type=float, default=420, help="for the whole run")
    p.add_argument(
        "--e2e", action="store_true", help="then launched-server parity on CUDA (e2e_tests.txt)"
    )
    p.add_argument("--e2e-tests", nargs="+", default=list(E2E_TESTS), help="pytest paths")
    p.add_argument("--e2e-filter", default="", help="pytest -k expression for --e2e")
    p.add_argument(
        "--e2e-workers", type=int, default=4, help="pytest -n (servers start slowly there)"
    )
    p.add_argument("--e2e-timeout-s", type=float, default=300, help="for the whole --e2e run")


def pytest_argv(tests: list[str], expression: str, *extra: str) -> list[str]:
    argv = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *tests]
    return argv + (["-k", expression] if expression else [])


def plan_cuda_tests(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = [
        Command(
            pytest_argv(args.tests, args.filter),
            "cuda_tests.txt",
            env={"AERIE_SPEC_TEST_DEVICE": "cuda"},
            timeout_s=args.timeout_s,
        )
    ]
    if args.e2e:
        workers = ("-n", str(args.e2e_workers), "--timeout", "150")
        steps.append(
            Command(
                pytest_argv(args.e2e_tests, args.e2e_filter, *workers),
                "e2e_tests.txt",
                env={"AERIE_E2E_DEVICE": "cuda"},
                timeout_s=args.e2e_timeout_s,
            )
        )
    return steps


def add_train_step(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2_SHAPE, help="its config.json is all it reads")
    p.add_argument("--algorithms", default="eagle3,mtp", help="comma list")
    p.add_argument("--shapes", default="16x1024,32x512,8x2048", help="ROWSxLENGTH, comma list")
    p.add_argument("--losses", default="reference,fused", help="soft cross-entropy variants")
    p.add_argument("--windows", default="on", help="on, off or on,off (the response window)")
    p.add_argument("--prompt-frac", type=float, default=0.3, help="each row's prompt share")
    p.add_argument("--prompt-spread", type=float, default=0.0, help="spread of that share")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="steps before timing")
    p.add_argument("--profile-steps", type=int, default=2, help="steps profiled for kernels")
    p.add_argument(
        "--generate-batch-sizes",
        type=int_list,
        default="",
        help="then the generation speed (random weights), one wave per batch size",
    )
    p.add_argument(
        "--prompts", default=".device-carry/train_a/prompts_a.npz", help="for the generation"
    )
    p.add_argument("--max-new-tokens", type=int, default=384, help="per generated answer")
    p.add_argument("--timeout-s", type=float, default=540, help="for the step benchmark")


def plan_train_step(args: argparse.Namespace) -> list[Step]:
    argv = bench(
        "bench_train_step",
        *("--model", args.model, "--load-format", "dummy", "--algorithms", args.algorithms),
        *("--shapes", args.shapes, "--steps", args.steps, "--warmup", args.warmup),
        *("--losses", args.losses, "--windows", args.windows),
        *("--prompt-frac", args.prompt_frac, "--prompt-spread", args.prompt_spread),
        *("--check-target", "--profile-steps", args.profile_steps),
        *("--output", out_file(args, "train_step.json")),
    )
    steps: list[Step] = [Command(argv, "train_step.txt", timeout_s=args.timeout_s)]
    for bs in args.generate_batch_sizes:
        gen = os.path.join(tempfile.gettempdir(), f"aerie_gen_{bs}.npz")
        argv = [PYTHON, "-m", "training", "generate", "--model", args.model]
        argv += ["--load-format", "dummy", "--prompts", args.prompts, "--out", gen]
        argv += ["--max-minutes", "0.01", "--batch-size", str(bs)]
        argv += ["--max-new-tokens", str(args.max_new_tokens), "--sampled-per-prompt", "0"]
        steps.append(Command(argv, f"generate_bs{bs}.txt", timeout_s=120))
    return steps


SUITES = [
    Suite(
        "decode",
        "the plain decode step, variant by variant",
        add_decode,
        plan_decode,
        ("wheels", "smollm2-config"),
    ),
    Suite(
        "iteration",
        "a speculative iteration against the plain step",
        add_iteration,
        plan_iteration,
        ("wheels", "smollm2-config", "llama8b"),
    ),
    Suite("kernels", "projection and attention kernels", add_kernels, plan_kernels, ("wheels",)),
    Suite("cuda-tests", "the CUDA test suites", add_cuda_tests, plan_cuda_tests, ("wheels",)),
    Suite(
        "train-step",
        "what a training step costs",
        add_train_step,
        plan_train_step,
        ("wheels", "smollm2-config", "train_a (with --generate-batch-sizes)"),
    ),
]
