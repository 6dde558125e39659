"""`bench_speculative.py --mode requests`: MT-bench questions served one at a time by the engine
of a launched server, plain and with speculation.

The configuration goes through `resolve_config` like `launch.py`'s (so the default model gets
its shipped draft, CUDA graphs and the Triton backend on a GPU), and the requests run through
the real `Scheduler` core and `GPUWorker` in one process, with the server's overlap schedule
(up to `Scheduler.max_in_flight` plans launched before the oldest result is applied); only the
sockets are left out (the engine loop is the tests' `tests/engine_loop.drive`, so the benchmark
runs what the tests check). Each question is a conversation of its turns (MT-bench has two),
asked in order at batch 1: a turn's request is the chat-templated conversation so far (earlier
turns with this run's own answers to them), decoded to its end-of-turn token or
`max_new_tokens`. This is how MT-bench is answered, and how published speculative-decoding
evaluations on it run (both turns, up to 512 new tokens each).

Per run: decode tokens/s (tokens after the first over the time after the first, summed over
the requests), the accept length (tokens per verify forward, bonus included, as
`meta_info.spec_accept_length` reports it) and the acceptance per position: the share of
decode iterations that accepted at least k + 1 tokens (k = 1..S), i.e. whose k-th draft
token was accepted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from aerie.codec import pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import SamplingParams, TokenizedRequest
from aerie.model_info import read_model_info
from aerie.resolve import resolve_config
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
    accepts: list[int]  # tokens accepted by each decode iteration
    requests: int = 0

    def summary(self, depth: int) -> dict:
        accepts = np.asarray(self.accepts, dtype=np.int64)
        counts = np.bincount(accepts, minlength=depth + 2) if len(accepts) else np.zeros(1)
        per_position = [float(counts[k + 1 :].sum() / max(len(accepts), 1))
                        for k in range(1, depth + 1)]  # fmt: skip
        return {
            "mode": self.mode, "temperature": self.temperature,
            "requests": self.requests, "decode_tokens": self.decode_tokens,
            "seconds": self.decode_seconds,
            "tokens_per_s": self.decode_tokens / max(self.decode_seconds, 1e-9),
            "accept_length": self.decode_tokens / self.verify if self.verify else None,
            "accept_per_position": per_position if self.verify else None,
        }  # fmt: skip

    def add(self, other: RunResult) -> None:
        self.decode_tokens += other.decode_tokens
        self.decode_seconds += other.decode_seconds
        self.verify += other.verify
        self.accepts += other.accepts
        self.requests += other.requests


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
        counts = {"tokens": 0, "verify": 0, "first_at": None}
        accepts: list[int] = []
        emitted_ids: list[int] = []

        def count(plan, result, deltas) -> None:
            for delta in deltas.deltas if deltas else []:
                ids = unpack_ids(delta.token_ids)
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
        result = RunResult("one request", params.temperature, counts["tokens"], seconds,
                           counts["verify"], accepts, requests=1)  # fmt: skip
        return result, emitted_ids


def run(engine: Engine, tokenizer: Tokenizer, questions: list[list[str]], name: str,
        temperature: float, max_new_tokens: int, seed: int = 0) -> list[RunResult]:  # fmt: skip
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
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                    seed=seed + i * turns + turn if temperature > 0 else None)
            result, answer = engine.serve(tokenizer.encode_chat(messages), params)
            totals[turn].add(result)
            messages.append({"role": "assistant", "content": tokenizer.decode(answer)})
    return totals
