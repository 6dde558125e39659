"""The suites on the real default model and its shipped drafts: `spec-serving` (plain and
speculative servers as a user meets them, bench_spec_serving.py) and `mtbench` (the drafts on
MT-bench at batch 1, bench_speculative.py). On the device the model arrives as two GGUF halves
over two calls; `--setup` joins them and the suite converts the GGUF once, into the directory
launch.py takes for the default model (so servers pick its shipped drafts from aerie/drafts).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
from pathlib import Path

from aerie.default_model import GGUF_FILENAME, default_model_dir
from benchmarks.runner import PYTHON, Call, Command, Step, SuiteError
from benchmarks.suites import (
    Suite,
    bench,
    int_list,
    name_list,
    number_list,
    out_file,
    shape_list,
)

# Where the device staging script joins the carried halves of the default model's GGUF.
DEVICE_GGUF = os.path.join("~", "aerie-models", GGUF_FILENAME)
MT_BENCH = ".device-carry/mt_bench_questions.jsonl"
HALVES = "model1 and model2 (the model's GGUF halves, a call each)"
# A half (49 MB) and the tree's shipped drafts (53 MB) do not fit one call's 64 MiB together.
THREE_CALLS = (
    "The tree's shipped drafts and a GGUF half exceed one call's 64 MiB: with aerie/drafts moved "
    "out of the tree, carry model1 (with the wheels), then model2, each call running `bash "
    ".device-carry/on_device.sh`; then run the suite with --setup and the drafts back in the "
    "tree, carrying neither half (the machine keeps $HOME between calls while warm)."
)


def real_model_steps(model: str, gguf: str) -> list[Step]:
    """Convert the joined GGUF into `model` when that holds no model yet."""
    model, gguf = os.path.expanduser(model), os.path.expanduser(gguf)
    if os.path.isfile(os.path.join(model, "config.json")) or not os.path.isfile(gguf):
        return []
    return [Command([PYTHON, "tools/convert_gguf.py", gguf, model], log="convert_gguf.log")]


def add_real_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model-path",
        default=default_model_dir(),
        help="the real default model (where launch.py looks for it, so servers find its "
        "shipped drafts in aerie/drafts)",
    )
    p.add_argument(
        "--gguf",
        default=DEVICE_GGUF,
        help="the joined GGUF (--setup joins the carried halves), converted into --model-path "
        "first when that has no config.json",
    )


def add_spec_serving(p: argparse.ArgumentParser) -> None:
    add_real_model(p)
    p.add_argument(
        "--servers",
        nargs="+",
        default=["plain", "eagle3", "eagle3-fixed", "mtp"],
        help="NAME or NAME=ARGS (bench_spec_serving.py --help)",
    )
    p.add_argument("--temperatures", type=number_list, default="0,0.7,1.0", help="comma list")
    p.add_argument("--concurrency", type=int_list, default="1,16,64,256", help="comma list")
    p.add_argument("--turns", type=int_list, default="1", help="1, or 1,2: and second turns")
    p.add_argument(
        "--system-prompt-tokens", type=int, default=0, help="a system message every chat shares"
    )
    p.add_argument(
        "--num-prompts", type=int, default=0, help="per run (0: max(80, 4 x concurrency))"
    )
    p.add_argument("--max-new-tokens", type=int, default=256, help="per request")
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to the limit")
    p.add_argument("--prompts", default=MT_BENCH, help="MT-bench questions (.jsonl)")
    p.add_argument(
        "--extra-server-args", default="", help="appended to every server (write it with =)"
    )
    p.add_argument("--client-processes", type=int, default=0, help="0: 1, or 4 from 64 streams on")
    p.add_argument("--no-plot", action="store_true", help="no spec_serving.png")
    p.add_argument(
        "--divergence",
        metavar="RUN",
        help="save every run's answers (answers/ in --out) and compare each run with RUN "
        "(e.g. plain_turn1_T0_c1), a sampled run with RUN's server at its temperature, by "
        "tools/divergence.py, into divergence.json",
    )
    p.add_argument("--timeout-s", type=float, default=570, help="for the whole grid")
    p.add_argument(
        "--step-trace",
        action="store_true",
        help="AERIE_STEP_TRACE on every server (into ~/trace_NAME), then each summarised "
        "(trace_NAME_MODE.json: plain steps and speculative iterations, at the smallest "
        "concurrency)",
    )
    p.add_argument(
        "--host-profile",
        metavar="FIRST,COUNT",
        help="AERIE_HOST_PROFILE of plans FIRST .. FIRST+COUNT-1 on every server "
        "(profile_NAME/{gpu_worker,scheduler}.txt in --out)",
    )


def server_names(servers: list[str]) -> list[str]:
    """The names bench_spec_serving.py gives its servers (plain first), by its own parser."""
    from benchmarks.bench_spec_serving import parse_servers

    return [setting.name for setting in parse_servers(servers)]


def plan_spec_serving(args: argparse.Namespace) -> list[Step]:
    env, summaries = [], []
    if args.step_trace:
        traces = os.path.join(os.path.expanduser("~"), "trace_{server}")  # large: not in --out
        env += ["--server-env", f"AERIE_STEP_TRACE=1,10000000,{traces}"]
        batch = str(min(args.concurrency))
        for name in server_names(args.servers):
            trace = traces.replace("{server}", name)
            for mode in ("decode", "speculate"):
                summary = out_file(args, f"trace_{name}_{mode}.json")
                argv = [PYTHON, "tools/step_trace_summary.py", trace, "--mode", mode]
                argv += ["--batch-size", batch, "--json", summary]
                summaries.append(Command(argv, f"trace_{name}_{mode}.txt"))
    if args.host_profile:
        first, _, count = args.host_profile.partition(",")
        if not (first.isdigit() and count.isdigit() and int(first) >= 1 and int(count) >= 1):
            raise SuiteError(f"--host-profile takes FIRST,COUNT, not {args.host_profile!r}")
        profiles = out_file(args, "profile_{server}")
        env += ["--server-env", f"AERIE_HOST_PROFILE={first},{count},{profiles}"]
    argv = bench(
        "bench_spec_serving",
        *("--model-path", os.path.expanduser(args.model_path), "--servers", *args.servers),
        *("--temperatures", ",".join(args.temperatures)),
        *("--concurrency", ",".join(map(str, args.concurrency))),
        *("--turns", ",".join(map(str, args.turns))),
        *(
            ("--system-prompt-tokens", args.system_prompt_tokens)
            if args.system_prompt_tokens
            else ()
        ),
        *(("--num-prompts", args.num_prompts) if args.num_prompts else ()),
        *("--max-new-tokens", args.max_new_tokens, "--prompts", args.prompts),
        *(("--ignore-eos",) if args.ignore_eos else ()),
        *((f"--extra-server-args={args.extra_server_args}",) if args.extra_server_args else ()),
        *(("--client-processes", args.client_processes) if args.client_processes else ()),
        *("--output", out_file(args, "spec_serving.json")),
        *(("--save-outputs", out_file(args, "answers")) if args.divergence else ()),
        *(() if args.no_plot else ("--plot", out_file(args, "spec_serving.png"))),
        *env,
    )
    steps = real_model_steps(args.model_path, args.gguf)
    run = Command(argv, "spec_serving.txt", timeout_s=args.timeout_s)
    if args.divergence:
        compare = functools.partial(compare_answers, args.out, args.divergence, args.model_path)
        summaries.append(Call(f"compare the runs with {args.divergence}", compare))
    return [*steps, run, *summaries]


def compare_answers(out: str, base: str, model_path: str) -> None:
    """tools/divergence.py over every run of base's turn in out/answers against base's server
    and concurrency at the run's temperature (base names the greedy run:
    SERVER_turnN_T0_cC), into out/divergence.json, on the GPU when there is one. A sampled
    request carries a seed, so a sampled run is compared with the base's run at its
    temperature: under a deterministic server both must match token for token; in the
    default mode the logit gap is a greedy pick's explanation and only the identical count
    is meaningful for them."""
    import torch

    from tools import divergence

    answers = Path(out, "answers")
    server, turn, greedy, streams = parse_run(base)
    if greedy != "T0":
        raise SuiteError(f"--divergence {base}: name the greedy run (T0)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits_of = divergence.reference_logits(os.path.expanduser(model_path), device)
    reports = {}
    # another turn asks other prompts; another temperature answers differently
    runs = sorted(answers.glob(f"*_{turn}_T*_*.json"), key=lambda p: (parse_run(p.stem)[2], p))
    for run in runs:
        temperature = parse_run(run.stem)[2]
        reference = answers / f"{server}_{turn}_{temperature}_{streams}.json"
        if run == reference:
            continue
        if not reference.exists():
            print(f"  {run.stem}: not compared, no {reference.stem} to compare it with")
            continue
        reports.update(divergence.compare_with(reference, [run], logits_of))
        reports[run.stem]["base"] = reference.stem
    Path(out, "divergence.json").write_text(json.dumps(reports, indent=1))
    for name, report in reports.items():
        print(f"  {report.get('base', base)} against {name}:", flush=True)
        divergence.print_report(report)


def parse_run(name: str) -> tuple[str, str, str, str]:
    """SERVER_turnN_TX_cC (the server's name may hold underscores) -> its four parts."""
    match = re.fullmatch(r"(.+)_(turn\d+)_(T[0-9.]+)_(c\d+)", name)
    if match is None:
        raise SuiteError(f"{name!r} is no run name (SERVER_turnN_TX_cC)")
    return match.group(1), match.group(2), match.group(3), match.group(4)


def add_mtbench(p: argparse.ArgumentParser) -> None:
    add_real_model(p)
    p.add_argument(
        "--drafts",
        default="",
        help="ALGO=DIR,... (e.g. EAGLE3=~/train/eagle3/draft from the train suite); "
        "default: the shipped drafts",
    )
    p.add_argument(
        "--shapes",
        type=shape_list,
        default="3,1,4 5,1,6 5,4,8 6,8,32 MTP:3,1,4 EAGLE:3,1,4",
        help="S,topk,ND triples, each optionally ALGO: prefixed",
    )
    p.add_argument("--temperatures", type=number_list, default="0", help="comma list")
    p.add_argument("--greedy-only", default="EAGLE S=3 topk=1 ND=4", help="modes run at T = 0 only")
    p.add_argument("--turns", type=int, default=2, help="turns asked per question")
    p.add_argument("--num-prompts", type=int, default=80, help="questions")
    p.add_argument("--max-new-tokens", type=int, default=512, help="per turn")
    p.add_argument("--prompts", default=MT_BENCH, help="MT-bench questions (.jsonl)")
    p.add_argument("--timeout-s", type=float, default=540, help="for the whole run")


def plan_mtbench(args: argparse.Namespace) -> list[Step]:
    pairs = [pair.partition("=") for pair in name_list(args.drafts)]
    drafts = ",".join(f"{algo}{eq}{os.path.expanduser(path)}" for algo, eq, path in pairs)
    argv = bench(
        "bench_speculative",
        *("--model-path", os.path.expanduser(args.model_path)),
        *(("--draft-path", drafts) if drafts else ()),
        *("--shapes", args.shapes, "--temperatures", ",".join(args.temperatures)),
        *(("--greedy-only", args.greedy_only) if args.greedy_only else ()),
        *("--prompts", args.prompts, "--num-prompts", args.num_prompts),
        *("--max-running-requests", 1, "--turns", args.turns),
        *("--max-new-tokens", args.max_new_tokens),
        *("--output", out_file(args, "bench_mtbench.json")),
    )
    steps = real_model_steps(args.model_path, args.gguf)
    return steps + [Command(argv, "bench_mtbench.txt", timeout_s=args.timeout_s)]


SUITES = [
    Suite(
        "spec-serving",
        "served speculation: plain and speculative servers (shipped drafts in the tree)",
        add_spec_serving,
        plan_spec_serving,
        ("wheels", HALVES, "mt_bench_questions.jsonl"),
        about=THREE_CALLS,
    ),
    Suite(
        "mtbench",
        "the drafts on MT-bench at batch 1",
        add_mtbench,
        plan_mtbench,
        ("wheels", HALVES, "mt_bench_questions.jsonl"),
        about=THREE_CALLS,
    ),
]
