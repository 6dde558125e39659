"""Served speculative decoding as a user meets it: launch each server, load it, compare.

    python3 benchmarks/bench_spec_serving.py --output spec_serving.json --plot spec_serving.png

Each `--servers` setting (`plain` first, the baseline; `eagle3`, `eagle3-fixed`, `mtp`, or
NAME=ARGS) is launched, loaded at every turn x temperature x concurrency and stopped; tokens/s
against plain, TPOT, ITL, acceptance and a step's served cost (docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
import uvloop
from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # run as a script

from benchmarks.bench_serving import summarize  # noqa: E402
from benchmarks.launched_server import LaunchedServer, LaunchError  # noqa: E402
from benchmarks.process_cpu import CpuMeter  # noqa: E402
from benchmarks.serving_load import Payload, run_load, run_load_processes  # noqa: E402
from benchmarks.spec_prompts import (  # noqa: E402
    DEFAULT_PROMPTS,
    MT_BENCH,
    Prompt,
    accept_length_by_kind,
    first_turns,
    load_questions,
    load_tokenizer,
    make_payloads,
    second_turns,
    system_prompt,
    user_turn,
    with_second_turns,
)
from training.repetition import repeated_share  # noqa: E402

BUILTIN_SERVERS = {
    "plain": "",
    "eagle3": "--speculative-algorithm EAGLE3",
    "eagle3-fixed": "--speculative-algorithm EAGLE3 --speculative-adaptive off",
    "mtp": "--speculative-algorithm MTP",
}
MANY_CLIENTS_CONCURRENCY, MANY_CLIENTS = 64, 4  # one client process falls behind past this
ACCEPTED = "aerie_spec_accepted_tokens"
PLAIN_STEPS = "aerie_spec_plain_steps"
DECODE_STEPS = "aerie_decode_steps"
CACHED_TOKENS = "aerie_prefix_cache_hit_tokens"
BUSY_GAUGES = ("aerie_num_running_requests", "aerie_num_queued_requests")
# Requests per stream in a run: with two, a run at 64 streams lasted about a second and its ratio
# moved by 0.2 between runs (arrival burst and tail weigh as much as the steady state).
PROMPTS_PER_STREAM = 4


@dataclasses.dataclass(frozen=True)
class ServerSetting:
    name: str
    args: tuple[str, ...]


def parse_servers(items: list[str]) -> list[ServerSetting]:
    """Builtin names or NAME=ARGS; `plain` first, added when missing."""
    settings: dict[str, ServerSetting] = {}
    for item in items:
        name, sep, args = item.partition("=")
        name = name.strip()
        if not sep and name not in BUILTIN_SERVERS:
            raise SystemExit(
                f"unknown server {name!r}: use one of {', '.join(BUILTIN_SERVERS)} or NAME=ARGS"
            )
        if not name or name in settings:
            raise SystemExit(f"--servers: empty or repeated name in {item!r}")
        settings[name] = ServerSetting(
            name, tuple(shlex.split(args if sep else BUILTIN_SERVERS[name]))
        )
    plain = settings.pop("plain", ServerSetting("plain", ()))
    return [plain, *settings.values()]


# --------------------------------------------------------------------------------------------
# Counters


@dataclasses.dataclass(frozen=True)
class SpecCounters:
    accepted: tuple[float, ...]  # [position]: verify steps that emitted more than k tokens
    plain_steps: float
    decode_steps: float = 0.0  # plain steps and iterations alike
    cached_tokens: float = 0.0  # prompt tokens reused from the prefix cache


def parse_counters(text: str) -> SpecCounters:
    """The speculative counters of a /metrics scrape (absent: none, 0)."""
    accepted: dict[int, float] = {}
    plain = decode = cached = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if name == ACCEPTED:
                accepted[int(sample.labels["position"])] = sample.value
            elif name == PLAIN_STEPS:
                plain += sample.value
            elif name == DECODE_STEPS:
                decode += sample.value
            elif name == CACHED_TOKENS:
                cached += sample.value
    accepted_list = tuple(accepted.get(k, 0.0) for k in range(len(accepted)))
    return SpecCounters(accepted_list, plain, decode, cached)


def spec_stats(before: SpecCounters, after: SpecCounters, num_steps: int = 0) -> dict:
    """Accept length, per-position acceptance and plain-step share of the steps in between.
    Positions up to `num_steps` (the draft depth) are listed even if none was ever accepted:
    the server lists a position once it is first accepted."""
    positions = max(len(after.accepted), num_steps + 1 if any(after.accepted) else 0)
    before_at, after_at = (dict(enumerate(c.accepted)) for c in (before, after))
    delta = [after_at.get(k, 0.0) - before_at.get(k, 0.0) for k in range(positions)]
    plain = after.plain_steps - before.plain_steps
    verify = delta[0] if delta else 0.0  # one a request an iteration
    decode = after.decode_steps - before.decode_steps  # one a batch a step
    steps = decode or plain + verify  # (a server without the decode-step counter: batch 1)
    return {
        "decode_steps": decode,
        "verify_steps": verify,
        "plain_steps": plain,
        "accepted_delta": delta,
        "accept_length": sum(delta) / verify if verify else None,
        "accept_per_position": [d / verify for d in delta[1:]] if verify else [],
        "plain_step_share": plain / steps if steps else None,
        "cached_prompt_tokens": after.cached_tokens - before.cached_tokens,
    }


def scrape_idle(url: str, timeout_s: float = 30.0) -> SpecCounters:
    """The counters once the engine is idle and they stopped moving: the scheduler's last
    report may reach the frontend after the last response."""
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        families = text_string_to_metric_families(text)
        busy = any(s.value for f in families for s in f.samples if s.name in BUSY_GAUGES)
        counters = parse_counters(text)
        if (not busy and counters == last) or time.monotonic() > deadline:
            return counters
        last = counters
        time.sleep(0.1)


# --------------------------------------------------------------------------------------------
# Load


def send_load(url: str, payloads: list[Payload], concurrency: int, clients: int) -> tuple:
    """(results, wall seconds, the client's CPU seconds) of all payloads at once, at most
    `concurrency` in flight."""
    if clients <= 1:
        cpu = time.process_time()
        results, wall = uvloop.run(run_load(url, payloads, float("inf"), concurrency, seed=0))
        return results, wall, time.process_time() - cpu
    return run_load_processes(url, payloads, float("inf"), concurrency, 0, clients)


# --------------------------------------------------------------------------------------------
# Runs


def describe_machine() -> str:
    """The GPUs the servers run on, as nvidia-smi names them ("cpu" without one)."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split("\n")
    except (OSError, subprocess.SubprocessError):
        return "cpu"
    names = [name.strip() for name in names if name.strip()]
    if not names:
        return "cpu"
    return names[0] if len(names) == 1 else f"{len(names)} x {names[0]}"


class Bench:
    """The runs of one invocation and their JSON report, rewritten after every run."""

    def __init__(self, args: argparse.Namespace, questions: list[list[str]]) -> None:
        self.args, self.questions = args, questions
        self.tokenizer = load_tokenizer(args.model_path)
        self.num = max(default_num_prompts(args, max(args.concurrency)), args.warmup_prompts)
        # turn -> the prompts of every run (second turns once the plain server has answered)
        self.system = system_prompt(self.tokenizer, questions, args.system_prompt_tokens)
        self.prompts: dict[int, list[Prompt]] = {
            1: first_turns(self.tokenizer, questions, self.num, self.system)
        }
        self.start = time.monotonic()
        # (turn, T, concurrency) -> the plain server's (tok/s, ms per decode step) there
        self.plain: dict[tuple[int, float, int], tuple[float, float | None]] = {}
        self.num_steps = 0  # the draft depth of the server running now
        self.log_dir = tempfile.mkdtemp(prefix="aerie-spec-serving-")
        self.report: dict = {
            "args": dict(vars(args)),
            "model_path": args.model_path,
            "machine": describe_machine(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "log_dir": self.log_dir,
            "servers": {},
            "rows": [],
        }

    def say(self, text: str) -> None:
        elapsed = int(time.monotonic() - self.start)
        print(f"[{elapsed // 60:3d}:{elapsed % 60:02d}] {text}", flush=True)

    def save(self) -> None:
        tmp = self.args.output + ".partial"
        with open(tmp, "w") as f:
            json.dump(self.report, f, indent=2)
        os.replace(tmp, self.args.output)

    def run_server(self, setting: ServerSetting) -> None:
        args = self.args
        where = ["--model-path", args.model_path, "--port", str(args.port)]
        extra = shlex.split(args.extra_server_args)
        cmd = [sys.executable, "launch.py", *where, *setting.args, *extra]
        entry = self.report["servers"][setting.name] = {"command": shlex.join(cmd[1:])}
        log_path = os.path.join(self.log_dir, f"{setting.name}.log")
        self.say(f"{setting.name}: starting `{entry['command']}` (log {log_path})")
        try:
            env = server_env(args.server_env, setting.name)
            if env:
                entry["env"] = env
            server = LaunchedServer(cmd, log_path, args.startup_timeout_s, env)
        except LaunchError as e:
            entry["error"] = str(e)
            self.save()
            if setting.name == "plain":
                raise SystemExit(f"the plain server (the baseline) failed: {e}") from None
            self.say(f"{setting.name}: failed to start, skipped:\n{e}")
            return
        try:
            info = entry["server_info"] = httpx.get(server.url + "/server_info", timeout=10).json()
            self.num_steps = info.get("speculative_num_steps") or 0
            self.save()
            self.warm_up(server.url)
            if 2 in args.turns and 2 not in self.prompts:
                self.answer_first_turns(server.url)
            runs = [
                (n, t, c) for n in args.turns for t in args.temperatures for c in args.concurrency
            ]
            for i, (turn, temperature, concurrency) in enumerate(runs):
                self.say(
                    f"{setting.name} run {i + 1}/{len(runs)}: turn {turn}, temperature "
                    f"{temperature}, concurrency {concurrency}"
                )
                self.report["rows"].append(
                    self.run_one(setting.name, server.url, turn, temperature, concurrency)
                )
                self.say(describe(self.report["rows"][-1]))
                self.save()
        except (httpx.HTTPError, RuntimeError) as e:  # the server died mid-run
            entry["error"] = f"{type(e).__name__}: {e}\n{server.tail()}"
            self.say(f"{setting.name}: stopped by an error: {entry['error']}")
            self.save()
        finally:
            server.stop()

    def save_outputs(self, run: str, prompts: list[Prompt], results: list) -> None:
        """The run's prompts and answers (ids) as `tools/divergence.py` reads them."""
        os.makedirs(self.args.save_outputs, exist_ok=True)
        answers = [
            {"prompt_ids": p.ids, "output_ids": r.output_ids, "error": r.error}
            for p, r in zip(prompts, results, strict=True)
        ]
        with open(os.path.join(self.args.save_outputs, f"{run}.json"), "w") as f:
            json.dump(answers, f)

    def warm_up(self, url: str) -> None:
        """Kernels built and paths taken once per temperature before anything is timed."""
        num = self.args.warmup_prompts
        for temperature in self.args.temperatures if num else ():
            payloads = make_payloads(
                self.prompts[1][:num],
                temperature,
                min(32, self.args.max_new_tokens),
                self.args.ignore_eos,
            )
            send_load(url, payloads, num, 1)

    def answer_first_turns(self, url: str) -> None:
        """The second turns' context: this (the plain) server's greedy answers to the first
        turns of the questions that have a second."""
        asked = with_second_turns(self.questions)
        if not asked:
            raise SystemExit("--turns 2: no question in --prompts has a second turn")
        self.say(f"answering {len(asked)} first turns greedily for the second turns")
        first = [Prompt(user_turn(self.tokenizer, q[0], self.system), MT_BENCH) for q in asked]
        payloads = make_payloads(first, 0.0, self.args.max_new_tokens, False)
        results, _, _ = send_load(url, payloads, len(payloads), 1)
        failed = [r.error for r in results if not r.success]
        if failed:
            # Fatal: the second turns must follow the plain server's own answers.
            raise SystemExit(f"{len(failed)} first-turn answers failed: {failed[0]}")
        answers = [r.output_ids for r in results]
        self.prompts[2] = second_turns(
            self.tokenizer, self.questions, answers, self.num, self.system
        )

    def prepare_cache(self, url: str, prompts: list[Prompt]) -> None:
        """Every run starts from a flushed prefix cache (no run reuses an earlier run's
        prompts); a second turn's run then has its chats' first turns prefilled, as a chat
        server would have them from answering those turns."""
        r = httpx.post(url + "/flush_cache", json={}, timeout=60)
        if r.status_code == 404:
            return  # a server without a prefix cache
        r.raise_for_status()
        histories = {tuple(p.ids[: p.history_len]) for p in prompts if p.history_len}
        if histories:
            payloads = make_payloads([Prompt(list(h), MT_BENCH) for h in histories], 0.0, 1, True)
            send_load(url, payloads, 16, 1)

    def run_one(self, name: str, url: str, turn: int, temperature: float, concurrency: int) -> dict:
        args = self.args
        num = default_num_prompts(args, concurrency)
        clients = args.client_processes or (
            MANY_CLIENTS if concurrency >= MANY_CLIENTS_CONCURRENCY else 1
        )
        prompts = self.prompts[turn][:num]
        prompt_tokens = sum(len(p.ids) for p in prompts)
        payloads = make_payloads(prompts, temperature, args.max_new_tokens, args.ignore_eos)
        self.prepare_cache(url, prompts)
        before, meter = scrape_idle(url), CpuMeter()
        results, wall, client_cpu = send_load(url, payloads, concurrency, clients)
        shares = {**meter.shares(), "client": round(client_cpu / max(wall, 1e-9), 3)}
        spec = spec_stats(before, scrape_idle(url), self.num_steps)
        summary = summarize(results, wall, None, shares)
        tok_s = summary["output_throughput"]
        key = turn, temperature, concurrency
        steps = spec["decode_steps"]
        step_ms = 1000 * wall / steps if steps else None  # prefills and idle time included
        if name == "plain":
            self.plain[key] = tok_s, step_ms
        plain, plain_step = self.plain.get(key, (None, None))
        ratio = tok_s / plain if plain else None
        errors = sorted({r.error for r in results if r.error})[:3]
        if args.save_outputs:
            run = f"{name}_turn{turn}_T{temperature:g}_c{concurrency}"
            self.save_outputs(run, prompts, results)
        return {
            "server": name,
            "turn": turn,
            "temperature": temperature,
            "concurrency": concurrency,
            "num_prompts": num,
            "client_processes": clients,
            "output_tok_s": tok_s,
            "ratio_to_plain": ratio,
            "tpot_ms_mean": summary["tpot_ms"]["mean"],
            "itl_ms_mean": summary["token_itl_ms"]["mean"],
            "ttft_ms_mean": summary["ttft_ms"]["mean"],
            "cached_prompt_share": spec["cached_prompt_tokens"] / prompt_tokens
            if prompt_tokens
            else 0.0,
            "ms_per_decode_step": step_ms,
            "step_cost_in_plain_steps": step_ms / plain_step if step_ms and plain_step else None,
            **spec,
            "accept_length_by_kind": accept_length_by_kind(prompts, results),
            "repeated_share": repeated_share(r.output_ids for r in results if r.success),
            "errors": errors,
            "summary": summary,
        }


def describe(row: dict) -> str:
    figures = [
        f"{row['output_tok_s']:.1f} tok/s",
        f"{show(row['ratio_to_plain'])}x plain",
        f"TPOT {row['tpot_ms_mean']:.2f} ms",
        f"accept length {show(row['accept_length'])}",
        f"repeated {row['repeated_share']:.1%}",
    ]
    kinds = row["accept_length_by_kind"]
    if any(v is not None for v in kinds.values()):
        figures.append("by kind " + ", ".join(f"{k} {show(v)}" for k, v in kinds.items()))
    summary = row["summary"]
    shares = ", ".join(f"{name} {share:.2f}" for name, share in summary["cpu_share"].items())
    return (
        f"  {summary['completed']}/{row['num_prompts']} done in {summary['duration_s']:.1f} s: "
        + ", ".join(figures)
        + (f"\n  CPU share (cores): {shares}" if shares else "")
    )


def show(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict]) -> None:
    columns = [
        ("tok/s", "output_tok_s", ".1f"),
        ("x plain", "ratio_to_plain", ".2f"),
        ("TPOT ms", "tpot_ms_mean", ".2f"),
        ("ITL ms", "itl_ms_mean", ".2f"),
        ("TTFT ms", "ttft_ms_mean", ".1f"),
        ("cached", "cached_prompt_share", ".1%"),
        ("step ms", "ms_per_decode_step", ".3f"),
        ("x step", "step_cost_in_plain_steps", ".2f"),
        ("accept", "accept_length", ".2f"),
        ("plain", "plain_step_share", ".1%"),
        ("repeat", "repeated_share", ".1%"),
    ]
    print(
        f"{'server':<16}{'turn':>5}{'temp':>6}{'conc':>6}"
        + "".join(f"{c[0]:>10}" for c in columns)
        + "  acceptance at k = 1, 2, ..."
    )
    for r in rows:
        cells = "".join(f"{show(r[key], spec):>10}" for _, key, spec in columns)
        per_position = " ".join(f"{a:.2f}" for a in r["accept_per_position"])
        print(
            f"{r['server']:<16}{r['turn']:>5}{r['temperature']:>6g}{r['concurrency']:>6}{cells}"
            f"  {per_position}"
        )


def server_env(items: list[str], server: str) -> dict[str, str]:
    """--server-env KEY=VALUE items as a dict, "{server}" in a value replaced by the server's
    name (so each server writes its own AERIE_STEP_TRACE or AERIE_HOST_PROFILE files)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--server-env: expected KEY=VALUE, got {item!r}")
        env[key] = value.replace("{server}", server)
    return env


def default_num_prompts(args: argparse.Namespace, concurrency: int) -> int:
    """Requests in a run at this concurrency: --num-prompts, else enough for a steady state."""
    return args.num_prompts or max(80, PROMPTS_PER_STREAM * concurrency)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--model-path", default=None, help="default: the default model (launch.py's)")
    p.add_argument(
        "--servers",
        nargs="+",
        default=list(BUILTIN_SERVERS),
        help="NAME (builtin) or NAME=ARGS (ARGS are the server's whole arguments)",
    )
    p.add_argument("--temperatures", default="0,0.7")
    p.add_argument("--turns", default="1", help="1: first turns; 1,2: and MT-bench second turns")
    p.add_argument(
        "--system-prompt-tokens",
        type=int,
        default=0,
        help="a system message of about this many tokens shared by every chat",
    )
    p.add_argument("--concurrency", default="1,16,64,256")
    p.add_argument(
        "--num-prompts",
        type=int,
        help=f"per run; default max(80, {PROMPTS_PER_STREAM} * concurrency)",
    )
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="every request runs to the limit")
    p.add_argument("--prompts", help="MT-bench questions (.jsonl); default: " + DEFAULT_PROMPTS)
    p.add_argument("--extra-server-args", default="", help="appended to every server's command")
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="environment for every server (repeatable); {server} in VALUE is the server's name",
    )
    p.add_argument("--port", type=int, default=30000, help="0: any free port")
    p.add_argument("--output", default="results.json")
    p.add_argument("--plot", metavar="PNG", help="ratios and acceptance (needs matplotlib)")
    p.add_argument(
        "--save-outputs",
        metavar="DIR",
        help="write each run's prompts and answers here (tools/divergence.py compares two)",
    )
    p.add_argument(
        "--client-processes",
        type=int,
        help=f"default 1, {MANY_CLIENTS} at concurrency >= {MANY_CLIENTS_CONCURRENCY}",
    )
    p.add_argument("--warmup-prompts", type=int, default=16, help="per temperature; 0: none")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    args = p.parse_args(argv)
    args.servers = parse_servers(args.servers)
    args.temperatures = [float(t) for t in args.temperatures.split(",")]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.turns = [int(t) for t in args.turns.split(",")]
    if not args.turns or not set(args.turns) <= {1, 2}:
        p.error(f"--turns takes 1 and 2, not {args.turns}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.model_path is None:  # as launch.py resolves it, converted once here
        from aerie.default_model import ensure_default_model

        args.model_path = ensure_default_model()
    questions = load_questions(args.prompts)
    settings, args.servers = args.servers, [[s.name, shlex.join(s.args)] for s in args.servers]
    bench = Bench(args, questions)
    for setting in settings:
        bench.run_server(setting)
    print_table(bench.report["rows"])
    if args.plot:
        from benchmarks.plot_spec_serving import plot

        plot(bench.report, args.plot)
    print(f"results: {args.output}" + (f", plot: {args.plot}" if args.plot else ""))
    return bench.report


if __name__ == "__main__":
    main()
