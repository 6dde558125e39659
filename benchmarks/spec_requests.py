"""`bench_speculative.py --mode requests`: MT-bench questions served one at a time by the engine
of a launched server (resolved as `launch.py` does, the real scheduler and worker with the
overlap schedule, no sockets), plain and with speculation, both turns of each question.

With `--step-costs` (a GPU's, from its `/server_info`) each shape also runs adaptive at those
costs, and every row is priced at them: decode tokens over (iterations x t_spec + plain steps x
t_plain). So a CPU shows what adaptive speculation chooses on a GPU and what the choice costs.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from aerie.codec import pack_ids
from aerie.config import AerieConfig
from aerie.messages import SamplingParams, TokenizedRequest
from aerie.model_info import read_model_info
from aerie.resolve import resolve_config
from aerie.step_costs import StepCosts
from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler
from tests.engine_loop import drive
from tokenizer_proc.tokenizer import Tokenizer


@dataclass
class RunResult:
    mode: str
    temperature: float
    decode_tokens: int
    decode_seconds: float
    verify: int  # verify forwards (0 without speculation)
    accepts: list[int]  # tokens emitted by each target forward (plain steps: 1)
    requests: int = 0
    plain_steps: int = 0  # decode steps adaptive speculation ran plainly

    def summary(self, depth: int) -> dict:
        accepts = np.asarray(self.accepts, dtype=np.int64)
        counts = np.bincount(accepts, minlength=depth + 2) if len(accepts) else np.zeros(1)
        per_position = [
            float(counts[k + 1 :].sum() / max(len(accepts), 1)) for k in range(1, depth + 1)
        ]
        return {
            "mode": self.mode,
            "temperature": self.temperature,
            "requests": self.requests,
            "decode_tokens": self.decode_tokens,
            "seconds": self.decode_seconds,
            "tokens_per_s": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "accept_length": self.decode_tokens / self.verify if self.verify else None,
            "accept_per_position": per_position if self.verify else None,
            "plain_steps": self.plain_steps,
        }

    def priced_speedup(self, costs: StepCosts) -> float:
        """Tokens per second at these step costs (batch 1), over plain decoding's."""
        ratio = costs.break_even(1, self.temperature > 0)  # an iteration, in plain steps
        iterations = self.verify - self.plain_steps
        steps = iterations * ratio + self.plain_steps if self.verify else self.decode_tokens
        return self.decode_tokens / max(steps, 1e-9)

    def add(self, other: RunResult) -> None:
        self.decode_tokens += other.decode_tokens
        self.decode_seconds += other.decode_seconds
        self.verify += other.verify
        self.accepts += other.accepts
        self.requests += other.requests
        self.plain_steps += other.plain_steps


def served_config(base: AerieConfig, speculative: dict, max_running: int) -> AerieConfig:
    """`base` with these speculative settings, resolved as `launch.py` resolves its flags."""
    config = base.replace(speculative=speculative, scheduler={"max_running_requests": max_running})
    return resolve_config(config)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Engine:
    """One resolved configuration's scheduler core and GPU worker."""

    def __init__(self, config: AerieConfig) -> None:
        self.config = config
        self.worker = GPUWorker(config)
        eos = read_model_info(config.model.model_path).eos_token_ids
        self.sched = Scheduler(config, eos, max_total_tokens=self.worker.runner.max_total_tokens)
        self.device = config.model.device

    def serve(self, prompt: list[int], params: SamplingParams) -> tuple[RunResult, list[int]]:
        """One request to its end -> (its decode figures, the token ids it emitted). Counts
        what the scheduler emits (stop-truncated, the extra token of a step in flight dropped);
        decode time runs from the first token's result."""
        self.sched.add_request(TokenizedRequest("bench", pack_ids(prompt), params))
        counts = {"tokens": 0, "verify": 0, "first_at": None, "plain": 0}
        accepts: list[int] = []
        emitted_ids: list[int] = []

        def count(plan, result, deltas) -> None:
            plain = plan.mode == "decode" and not plan.speculate and self.sched.speculative
            counts["plain"] += plain and counts["first_at"] is not None
            for delta in deltas:
                ids = delta.token_ids
                emitted_ids.extend(ids)
                emitted = len(ids)
                if counts["first_at"] is None:
                    if emitted == 0:
                        continue  # a prefill chunk before the last
                    counts["first_at"] = time.perf_counter()
                    emitted -= 1  # the first token, from the prefill
                counts["tokens"] += emitted
                if delta.spec_verify_ct > counts["verify"]:
                    accepts.append(emitted)
                    counts["verify"] = delta.spec_verify_ct

        drive(self.sched, self.worker, count)
        sync(self.device)
        first_at = counts["first_at"] or time.perf_counter()
        seconds = time.perf_counter() - first_at
        result = RunResult(
            "one request",
            params.temperature,
            counts["tokens"],
            seconds,
            counts["verify"],
            accepts,
            requests=1,
            plain_steps=counts["plain"],
        )
        return result, emitted_ids


def run(
    engine: Engine,
    tokenizer: Tokenizer,
    questions: list[list[str]],
    name: str,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
) -> list[RunResult]:
    """Every question's turns in order, each after the conversation so far (a short warm-up
    request first) -> one total per turn index (a question with fewer turns counts in fewer)."""
    first = tokenizer.encode_chat([{"role": "user", "content": questions[0][0]}])
    engine.serve(first, SamplingParams(max_new_tokens=8, temperature=0.0))
    turns = max(len(q) for q in questions)
    totals = [RunResult(name, temperature, 0, 0.0, 0, []) for _ in range(turns)]
    for i, question in enumerate(questions):
        messages: list[dict[str, str]] = []
        for turn, text in enumerate(question):
            messages.append({"role": "user", "content": text})
            params = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                seed=seed + i * turns + turn if temperature > 0 else None,
            )
            result, answer = engine.serve(tokenizer.encode_chat(messages), params)
            totals[turn].add(result)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
    return totals


def run_requests(
    args,
    questions: list[list[str]],
    shapes: list[tuple[str, tuple[int, int, int]]],
    drafts: dict[str, str | None],
) -> None:
    """--mode requests: each configuration once, every temperature on its engine."""

    base = AerieConfig().replace(
        model={
            "model_path": args.model_path,
            "device": args.device,
            "dtype": args.dtype,
            "load_format": args.load_format,
        },
        cache={"max_total_tokens": 65536},
        runner={"attention_backend": args.attention_backend},
    )
    temperatures = [float(t) for t in args.temperatures.split(",")]
    costs = StepCosts.from_json(args.step_costs) if args.step_costs else None
    results, plain_tps, used, tokenizer = [], {}, {}, None
    for algorithm, shape, adaptive in runs(shapes, costs is not None):
        spec = {}
        if shape is not None:
            spec = {
                "speculative_algorithm": algorithm,
                "speculative_draft_model_path": drafts.get(algorithm),
                "speculative_num_steps": shape[0],
                "speculative_eagle_topk": shape[1],
                "speculative_num_draft_tokens": shape[2],
            }
            if costs is not None:
                spec["speculative_adaptive"] = "on" if adaptive else "off"
                spec["speculative_step_costs"] = args.step_costs if adaptive else None
        engine = Engine(served_config(base, spec, args.max_running_requests))
        tokenizer = tokenizer or Tokenizer(engine.config.model.tokenizer_path)  # the same model
        name = "plain"
        if shape is not None:
            name = f"{algorithm} S={shape[0]} topk={shape[1]} ND={shape[2]}"
            name += " adaptive" if adaptive else ""
        for temperature in temperatures:
            if temperature > 0 and name in args.greedy_only.split(","):
                continue
            depth = 0 if shape is None else shape[0]
            per_turn = run(engine, tokenizer, questions, name, temperature, args.max_new_tokens)
            total = RunResult(name, temperature, 0, 0.0, 0, [])
            for result in per_turn:
                total.add(result)
            summary = total.summary(depth)
            summary["per_turn"] = []
            for turn in per_turn:
                figures = turn.summary(depth)
                summary["per_turn"].append(
                    {
                        key: figures[key]
                        for key in ("requests", "decode_tokens", "tokens_per_s", "accept_length")
                    }
                )
            if shape is None:
                plain_tps[temperature] = summary["tokens_per_s"]
            summary["speedup"] = summary["tokens_per_s"] / max(plain_tps[temperature], 1e-9)
            if costs is not None:
                summary["priced_speedup"] = total.priced_speedup(costs)
            results.append(summary)
            print(json.dumps(summary), flush=True)
            if algorithm is not None:
                used[algorithm] = engine.config.speculative.speculative_draft_model_path
            write_results(args.output, used, results)  # every row, in case a time limit hits
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print_requests(args, results, len(questions), used)


def runs(shapes: list, adaptive_too: bool) -> list[tuple]:
    """(algorithm, shape, adaptive) of each engine: plain first, then each shape, also
    adaptively where step costs are given."""
    twice = [(a, s, adaptive) for a, s in shapes for adaptive in (False, True)[: 1 + adaptive_too]]
    return [(None, None, False), *twice]


def write_results(path: str | None, drafts: dict, results: list[dict]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(
                {"command": " ".join(sys.argv), "drafts": drafts, "results": results}, f, indent=1
            )


def print_requests(args, results: list[dict], num_questions: int, drafts: dict) -> None:
    print(
        f"{num_questions} MT-bench questions, up to {args.turns} turns each, batch 1, up to "
        f"{args.max_new_tokens} new tokens per turn, {args.device} {args.dtype}, drafts {drafts}"
    )
    print(
        f"{'mode':41s} {'temp':>4s} {'tok/s':>8s} {'accept':>7s} {'speedup':>8s}  "
        f"{'plain':>6s} {'priced':>7s}  {'per turn':>11s}  P(accept >= k+1), k = 1..S"
    )
    for r in results:
        accept = f"{r['accept_length']:.2f}" if r["accept_length"] else "-"
        turns = " ".join(
            f"{t['accept_length']:.2f}" if t["accept_length"] else "-" for t in r["per_turn"]
        )
        per = " ".join(f"{p:.2f}" for p in r["accept_per_position"] or [])
        steps = (
            r["decode_tokens"]
            if r["accept_length"] is None
            else r["decode_tokens"] / r["accept_length"]
        )
        plain = f"{r['plain_steps'] / max(steps, 1):.0%}"
        priced = f"{r['priced_speedup']:.3f}x" if "priced_speedup" in r else "-"
        print(
            f"{r['mode']:41s} {r['temperature']:4.1f} {r['tokens_per_s']:8.1f} {accept:>7s} "
            f"{r['speedup']:7.2f}x  {plain:>6s} {priced:>7s}  {turns:>11s}  {per}"
        )
