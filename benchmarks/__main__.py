"""`python3 -m benchmarks SUITE [flags]`: the measurements behind docs/performance.md and
docs/drafts.md, each suite a named sequence of benchmark runs on the lent GPU machine.

    python3 -m benchmarks prepare                  # here, on CPU: builds .device-carry/
    python3 -m benchmarks iteration --dry-run      # the commands, one a line, nothing run

Logs go to --out (default $OUT); --setup first runs .device-carry/on_device.sh there.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from benchmarks import (
    device_carry,
    model_suites,
    serving_suites,
    streams_suite,
    suites,
    train_suite,
)
from benchmarks.runner import (
    REPO_ROOT,
    Command,
    Runner,
    Step,
    SuiteError,
    Terminated,
    dry_run_lines,
    raise_terminated,
)
from benchmarks.runner import setup_env as run_setup
from benchmarks.suites import Suite

SUITES = {
    suite.name: suite
    for suite in (
        device_carry.SUITE,
        *suites.SUITES,
        *model_suites.SUITES,
        *serving_suites.SUITES,
        streams_suite.SUITE,
        train_suite.SUITE,
    )
}
GPU_INFO = ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help; an empty one reads "none"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.option_strings and action.default in ("", None, []):
            return f"{action.help} (default: none)"
        return super()._get_help_string(action)


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out",
        default=os.environ.get("OUT") or "./bench-out",
        help="results and logs ($OUT if set, else ./bench-out)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--keep-going", action="store_true", help="run on past a failing command")
    p.add_argument(
        "--setup", action="store_true", help="on the device: run CARRY_DIR/on_device.sh first"
    )
    p.add_argument(
        "--carry-dir", default=".device-carry", help="carried files (relative: to the repo root)"
    )
    p.add_argument(
        "--env",
        type=env_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more environment for every command (repeatable)",
    )
    p.add_argument("--tail", type=int, default=15, help="log lines printed after each command")


def describe(suite: Suite) -> str:
    if not suite.on_device:
        return suite.help
    carries = ", ".join((*suite.carries, "on_device.sh"))
    return f"{suite.help}. Carry (under .device-carry/): {carries}. {suite.about}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for suite in SUITES.values():
        p = sub.add_parser(
            suite.name,
            help=suite.help,
            description=describe(suite),
            formatter_class=HelpFormatter,
        )
        suite.add_arguments(p)
        add_common(p)
    return parser


def plan(args: argparse.Namespace) -> list[Step]:
    suite = SUITES[args.suite]
    steps = suite.plan(args)
    if suite.on_device:
        steps = [Command(GPU_INFO, "gpu.txt"), *steps]
    return steps


def plan_or_exit(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Step]:
    try:
        return plan(args)
    except SuiteError as e:
        parser.exit(2, f"{parser.prog} {args.suite}: error: {e}\n")


def child_env(args: argparse.Namespace) -> dict[str, str]:
    # unbuffered: logs fill as a run goes; offline: the device reaches nothing outside
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", **dict(args.env)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.out = os.path.abspath(args.out)
    args.carry_dir = os.path.join(REPO_ROOT, args.carry_dir)
    setup = os.path.join(args.carry_dir, "on_device.sh")
    if args.dry_run:
        lines = dry_run_lines(plan_or_exit(parser, args))
        print("\n".join(([f"bash {setup}"] if args.setup else []) + lines))
        return 0
    env = child_env(args)
    if args.setup:  # before planning: the suite plans from the files it stages
        try:
            env.update(run_setup(setup))
        except (SuiteError, OSError) as e:
            print(f"benchmarks: {e}", file=sys.stderr)
            return 1
    steps = plan_or_exit(parser, args)
    os.makedirs(args.out, exist_ok=True)
    runner = Runner(args.out, env, args.keep_going, args.tail)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        signal.signal(signal.SIGTERM, raise_terminated)
        ok = runner.run(steps)
    except Terminated:
        print(f"benchmarks: {args.suite} terminated; its servers are stopped", file=sys.stderr)
        return 128 + signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    if ok:
        print(f"benchmarks: {args.suite} done; results in {args.out}")
        return 0
    print(f"benchmarks: {args.suite} failed:", file=sys.stderr)
    for failure in runner.failures:
        print(f"  {failure}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
