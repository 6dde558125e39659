"""The suites that launch servers and load them with bench_serving.py: `serving` (the overlap
schedule on and off, on the default model's shape with random weights) and `tp` (tensor- and
data-parallel layouts of the Llama-3.1-8B shape on a machine of several GPUs).
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import re
import shlex
import shutil

from benchmarks.host_profile import profile_serving
from benchmarks.runner import PYTHON, Call, Command, Server, Step, SuiteError
from benchmarks.suites import (
    LLAMA8B_SHAPE,
    SMOLLM2_SHAPE,
    Suite,
    bench,
    int_list,
    name_list,
    out_file,
    pytest_argv,
    word,
)

SHAREGPT_SUBSET = ".device-carry/sharegpt_subset.json"
# -nccl: --disable-custom-all-reduce; -det: --enable-deterministic-inference
LAYOUT = re.compile(r"(tp|dp)([1-9]\d*)(-nccl)?(-det)?")


def add_serving(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=SMOLLM2_SHAPE, help="model directory, tokenizer included")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument("--modes", type=name_list, default="on,off", help="overlap schedule on, off")
    p.add_argument(
        "--concurrency",
        type=int_list,
        default="64,1,8,32,128,256",
        help="one run each, all requests at once (1 streams over /generate, the rest over "
        "/v1/completions)",
    )
    p.add_argument(
        "--poisson-rate", type=float, default=32, help="then 256 requests at this rate (0: none)"
    )
    p.add_argument("--output-len", type=int, default=256, help="tokens per request, EOS ignored")
    p.add_argument(
        "--requests-at-1", type=int, default=8, help="requests at concurrency 1 (else 2 x it)"
    )
    p.add_argument("--dataset", default=SHAREGPT_SUBSET, help="ShareGPT JSON (prepare makes it)")
    p.add_argument(
        "--speculative",
        choices=("", "EAGLE3", "EAGLE", "MTP"),
        default="",
        help="serve with a random 3-step chain draft of this algorithm",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy requests")
    p.add_argument("--top-p", type=float, default=1.0, help="of sampled requests")
    p.add_argument("--client-processes", type=int, default=1, help="bench_serving's clients")
    p.add_argument("--max-running-requests", type=int, default=256, help="the server's rows")
    p.add_argument(
        "--pyspy-seconds",
        type=float,
        default=0,
        help="host profiles (py-spy) of every process this long in the runs at "
        "--pyspy-concurrency, which then send 8x the requests (0: none)",
    )
    p.add_argument("--pyspy-concurrency", type=int_list, default="64,1", help="comma list")
    p.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip bench_decode's compiled loop and graphed step at batch 1 and 64 first",
    )
    p.add_argument("--trace-cost", action="store_true", help="bench_trace_cost.py first")
    p.add_argument(
        "--idle-concurrency",
        type=int_list,
        default="64",
        help="then the GPU idle share: a profiled server of its own per concurrency and "
        "tracer ('': none)",
    )
    p.add_argument("--idle-tracers", type=name_list, default="graphs", help="graphs, kernels")
    p.add_argument(
        "--profile-steps",
        type=int_list,
        default="200,50",
        help="FIRST,COUNT of the profiled steps (at 64 streams: decode steps of all of them)",
    )
    p.add_argument(
        "--step-trace",
        action="store_true",
        help="AERIE_STEP_TRACE on the measured servers, summarised at batch 48-64 and 1",
    )
    add_server_flags(p, timeout_s=150, start_timeout_s=180)


def add_server_flags(p: argparse.ArgumentParser, timeout_s: float, start_timeout_s: float) -> None:
    p.add_argument("--port", type=int, default=30000, help="the server's HTTP port")
    p.add_argument("--server-args", default="", help="more launch.py arguments (write it with =)")
    p.add_argument("--timeout-s", type=float, default=timeout_s, help="per client run")
    p.add_argument(
        "--start-timeout-s", type=float, default=start_timeout_s, help="for a server to be up"
    )


def client(args: argparse.Namespace, model: str, conc: int, n: int, *extra: object) -> list[str]:
    """bench_serving.py against the launched server."""
    return bench(
        "bench_serving",
        *("--base-url", f"http://127.0.0.1:{args.port}"),
        *("--backend", "native" if conc == 1 else "openai", "--num-prompts", n),
        *("--max-concurrency", conc, "--dataset-path", args.dataset, "--tokenizer", model),
        *extra,
    )


def warm_up(args: argparse.Namespace, model: str, conc: int, name: str) -> Command:
    """Short requests at `conc` streams: the first prefills of new shapes build kernels."""
    argv = client(args, model, conc, conc, "--output-len", 16, "--seed", 7)
    return Command(argv, f"warmup_{name}.txt", timeout_s=args.timeout_s)


def launch_argv(args: argparse.Namespace, model: str, *extra: str) -> list[str]:
    argv = [PYTHON, "launch.py", "--model-path", model, "--load-format", args.load_format]
    return argv + ["--port", str(args.port), *extra, *shlex.split(args.server_args)]


def plan_serving(args: argparse.Namespace) -> list[Step]:
    if len(args.profile_steps) != 2:
        raise SuiteError("--profile-steps takes FIRST,COUNT")
    if not set(args.modes) <= {"on", "off"}:
        raise SuiteError(f"--modes takes on and off, not {','.join(args.modes)}")
    steps: list[Step] = []
    if not args.no_baseline:  # what the served rates are compared with
        output = out_file(args, "decode_baseline.json")
        argv = bench(
            "bench_decode",
            *("--models", args.model, "--load-format", args.load_format, "--batch-size", "1,64"),
            *("--decode-steps", 64, "--variants", "compiled,triton+graph", "--warmup-steps", 8),
            *("--repeats", 3, "--output", output),
        )
        steps.append(Command(argv, "decode_baseline.txt", timeout_s=200))
    if args.trace_cost:
        argv = bench("bench_trace_cost", "--output", out_file(args, "trace_cost.json"))
        steps.append(Command(argv, "trace_cost.txt", timeout_s=200))
    tag, spec = args.speculative or "plain", []
    if args.speculative:
        draft = out_file(args, f"random_{tag}_draft")
        write = functools.partial(write_random_draft, args.model, tag, draft)
        steps.append(
            Call(f"write a random {tag} draft config after {args.model} into {draft}", write)
        )
        spec = ["--speculative-algorithm", tag, "--speculative-draft-model-path", draft]
        spec += ["--speculative-num-steps", "3", "--speculative-eagle-topk", "1"]
        spec += ["--speculative-num-draft-tokens", "4"]
    for mode in args.modes:
        overlap = ["--disable-overlap-schedule"] if mode == "off" else []
        rows = ["--max-running-requests", str(args.max_running_requests)]
        server = launch_argv(args, args.model, *rows, *spec, *overlap)
        runs = [str(c) for c in args.concurrency] + (["poisson"] if args.poisson_rate > 0 else [])
        if runs:
            steps += measured_server(args, server, f"{tag}_{mode}", runs)
        for conc in args.idle_concurrency:
            for tracer in args.idle_tracers:
                steps += idle_server(args, server, f"{tag}_{mode}_c{conc}_{tracer}", conc, tracer)
    return steps


def measured_server(
    args: argparse.Namespace, server: list[str], name: str, runs: list[str]
) -> list[Step]:
    before: list[Step] = []
    after: list[Step] = []
    env = {}
    if args.step_trace:
        trace_dir = os.path.expanduser(f"~/trace_{name}")  # outside the out dir: large
        remove = functools.partial(shutil.rmtree, trace_dir, ignore_errors=True)
        before.append(Call(f"remove {trace_dir}", remove))
        env["AERIE_STEP_TRACE"] = f"1,1000000,{trace_dir}"
        for batch in ("48-64", "1"):
            summary = out_file(args, f"trace_{name}_b{batch}.json")
            argv = [PYTHON, "tools/step_trace_summary.py", trace_dir, "--batch-size", batch]
            after.append(Command(argv + ["--json", summary], f"trace_{name}_b{batch}.txt"))
    inner: list[Step] = [warm_up(args, args.model, args.max_running_requests, name)]
    inner += [client_run(args, name, run) for run in runs]
    merge = functools.partial(merge_summaries, args.out, name)
    server_step = Server(server, f"server_{name}.log", args.port, inner, env, args.start_timeout_s)
    return [*before, server_step, *after, Call(f"merge the runs into serving_{name}.json", merge)]


def client_run(args: argparse.Namespace, name: str, run: str) -> Command:
    if run == "poisson":
        conc, n, rate = 256, 256, word(args.poisson_rate)
    else:
        conc, rate = int(run), "inf"
        n = args.requests_at_1 if conc == 1 else 2 * conc
    spy = bool(args.pyspy_seconds) and run != "poisson" and conc in args.pyspy_concurrency
    if spy:
        n = max(8 * conc, 32)  # the run outlasts the profile
    sampling = ["--temperature", args.temperature] if args.temperature else []
    sampling += ["--top-p", args.top_p] if args.top_p != 1.0 else []
    if args.client_processes > 1:
        sampling += ["--client-processes", args.client_processes]
    argv = client(
        args,
        args.model,
        conc,
        n,
        *("--output-len", args.output_len, "--request-rate", rate, *sampling),
        *("--output", out_file(args, f"serve_{name}_c{run}.json")),
    )
    cmd = Command(argv, f"serve_{name}_c{run}.txt", timeout_s=args.timeout_s)
    if spy:
        summary = out_file(args, f"host_profile_{name}_c{run}.txt")
        cmd.during = profile_serving(args.port, conc, args.pyspy_seconds, summary)
        cmd.during_text = f"py-spy on every process for {word(args.pyspy_seconds)} s -> {summary}"
    return cmd


def idle_server(
    args: argparse.Namespace, server: list[str], name: str, conc: int, tracer: str
) -> list[Step]:
    """A server of its own with a window of steps profiled: the profiler slows every later
    launch, so no measured figure comes from it."""
    path = out_file(args, f"idle_{name}.json")
    first, count = args.profile_steps
    env = {"AERIE_PROFILE_STEPS": f"{first},{count},{path}", "AERIE_PROFILE_TRACER": tracer}
    argv = client(args, args.model, conc, max(conc, 4), "--output-len", args.output_len)
    load = Command(argv + ["--request-rate", "inf"], f"idle_{name}.txt", timeout_s=args.timeout_s)
    show = functools.partial(print_idle_share, path)
    log = f"server_idle_{name}.log"
    server_step = Server(server, log, args.port, [load], env, args.start_timeout_s)
    return [server_step, Call(f"print the GPU idle share in {os.path.basename(path)}", show)]


def write_random_draft(model: str, algorithm: str, directory: str) -> None:
    from benchmarks.bench_speculative import write_random_draft_config

    write_random_draft_config(model, algorithm, directory, 3)


def merge_summaries(out: str, name: str) -> None:
    """One file of every run's summary; the per-request files are removed (large)."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, f"serve_{name}_c*.json"))):
        with open(path) as f:
            runs[path.rsplit("_c", 1)[1].removesuffix(".json")] = json.load(f)["summary"]
        os.remove(path)
    with open(os.path.join(out, f"serving_{name}.json"), "w") as f:
        json.dump(runs, f, indent=1)


def print_idle_share(path: str) -> None:
    with open(path) as f:
        d = json.load(f)
    steps = d["steps"]
    print(
        f"  {os.path.basename(path)}: GPU idle {100 * d['idle_share']:.1f}% over {steps} steps, "
        f"busy {d['gpu_busy_us'] / steps:.0f} us/step, span {d['span_us'] / steps:.0f} us/step, "
        f"mean batch {d['mean_batch_size']:.1f}, steps {d['modes']}"
    )


def layout_list(text: str) -> list[str]:
    layouts = name_list(text)
    bad = [layout for layout in layouts if not LAYOUT.fullmatch(layout)]
    if bad or not layouts:
        raise argparse.ArgumentTypeError(f"expected tpN or dpN layouts, got {text!r}")
    return layouts


def add_tp(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=LLAMA8B_SHAPE, help="model directory, tokenizer included")
    p.add_argument("--load-format", default="dummy", help="dummy: random weights")
    p.add_argument(
        "--layouts",
        type=layout_list,
        default="tp1,tp2,dp2",
        help="one server each: tpN --tp-size N, dpN --dp-size N (one GPU a replica); a "
        "-nccl suffix adds --disable-custom-all-reduce, -det --enable-deterministic-inference",
    )
    p.add_argument(
        "--concurrency", type=int_list, default="128", help="runs after the one-stream run"
    )
    p.add_argument("--output-len", type=int, default=256, help="tokens per request, EOS ignored")
    p.add_argument("--dataset", default=SHAREGPT_SUBSET, help="ShareGPT JSON (prepare makes it)")
    p.add_argument("--skip-tests", action="store_true", help="no sharded tests on CUDA first")
    p.add_argument(
        "--all-reduce-world", type=int, default=2, help="GPUs of bench_all_reduce (0: skip it)"
    )
    p.add_argument(
        "--all-reduce-programs", default="32", help="bench_all_reduce --programs, comma list"
    )
    p.add_argument("--e2e-workers", type=int, default=3, help="pytest -n of the launched tests")
    p.add_argument("--e2e-filter", default="", help="pytest -k of the launched tests")
    add_server_flags(p, timeout_s=120, start_timeout_s=240)


def plan_tp(args: argparse.Namespace) -> list[Step]:
    steps: list[Step] = [Command(["nvidia-smi", "topo", "-m"], "topo.txt")]
    if not args.skip_tests:
        tests = ["tests/gpu_worker/test_peer_reduce.py", "tests/gpu_worker/test_tensor_parallel.py"]
        unit = pytest_argv(tests, "")
        steps.append(Command(unit, "tp_tests.txt", {"AERIE_TP_TEST_DEVICE": "cuda"}, 150))
        e2e = pytest_argv(
            ["tests/e2e/test_tensor_parallel.py"], args.e2e_filter, "-n", str(args.e2e_workers)
        )
        steps.append(Command(e2e, "tp_e2e_tests.txt", {"AERIE_E2E_DEVICE": "cuda"}, 300))
    if args.all_reduce_world > 1:
        bench = [PYTHON, "benchmarks/bench_all_reduce.py", "--world", str(args.all_reduce_world)]
        bench += ["--programs", args.all_reduce_programs, "--output"]
        bench.append(out_file(args, f"all_reduce_{args.all_reduce_world}gpu.json"))
        steps.append(Command(bench, "all_reduce.txt", timeout_s=300))
    for layout in args.layouts:
        kind, size, nccl, det = LAYOUT.fullmatch(layout).groups()
        rows = ["--max-running-requests", "128"]
        if nccl:
            rows.append("--disable-custom-all-reduce")
        if det:
            rows.append("--enable-deterministic-inference")
        server = launch_argv(args, args.model, f"--{kind}-size", size, *rows)
        inner: list[Step] = [warm_up(args, args.model, 64, layout)]
        for conc in [1, *args.concurrency]:
            argv = client(
                args,
                args.model,
                conc,
                8 if conc == 1 else 2 * conc,
                *("--output-len", args.output_len, "--max-input-len", 512, "--seed", 3),
                *("--output", out_file(args, f"serving_{layout}_c{conc}.json")),
            )
            inner.append(Command(argv, f"serving_{layout}_c{conc}.txt", timeout_s=args.timeout_s))
        steps.append(
            Server(server, f"server_{layout}.log", args.port, inner, {}, args.start_timeout_s)
        )
    return steps


SUITES = [
    Suite(
        "serving",
        "served load, overlap schedule on and off",
        add_serving,
        plan_serving,
        ("wheels", "smollm2-config", "sharegpt_subset.json"),
    ),
    Suite(
        "tp",
        "tensor and data parallelism on several GPUs",
        add_tp,
        plan_tp,
        ("wheels", "llama8b", "sharegpt_subset.json"),
    ),
]
