"""The scheduler process: moves messages between the sockets and the `Scheduler` core.

Inbox: TokenizedRequest / AbortRequest / DebugQuery (tokenizer), Shutdown (launcher); over
the step link (`aerie.transport.StepLink`, connected to its GPU worker at start-up): ForwardPlan
out, StepResult in. Out over ZMQ: each step's outputs as one StepOutputs per frontend that owns
some of them, SchedulerStats to every frontend, a DebugReport to the frontend that asked. Up to
`Scheduler.max_in_flight` plans are in flight (two with the overlap schedule): when a result
arrives the loop applies it, sends the next plan, and only then the outputs, so the worker has
its next step queued while the scheduler does the rest. The
loop blocks on its inbox while it cannot plan. What heartbeats report
(`aerie.process.Progress`): a pass of the loop, from the messages it got to the plans and
deltas it sent; idle while it waits for messages.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.host_profile import HostProfile
from aerie.messages import (
    AbortRequest,
    DebugQuery,
    DebugReport,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    StepResult,
    TokenizedRequest,
)
from aerie.model_info import read_model_info
from aerie.process import Progress, run_process
from aerie.step_trace import StepTrace
from aerie.transport import Inbox, Receiver, Sender, StepLink
from scheduler_proc.scheduler import Scheduler

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
# How long the loop polls without sleeping for the result of a step in flight, before it
# blocks: longer than a step of a small model, short enough not to hold a core for a long
# prefill or a stalled worker.
RESULT_SPIN_S = 0.005


def load_decoder(tokenizer_path: str) -> Callable[[list[int]], str]:
    """ids -> text with the model's tokenizer (stop strings need it), loaded now: loading it on
    the first request with a stop string would stall every running stream for seconds.

    The `tokenizers` library reads tokenizer.json in a fraction of a second and without torch;
    transformers (which imports torch) is the fallback for tokenizers without that file or
    with `clean_up_tokenization_spaces`, whose decode differs from the raw one."""
    tokenizer_json = os.path.join(tokenizer_path, "tokenizer.json")
    if os.path.isfile(tokenizer_json) and not _cleans_up_spaces(tokenizer_path):
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(tokenizer_json)

        def decode_tokens(ids: list[int]) -> str:
            return fast.decode(ids, skip_special_tokens=False)

    else:
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(tokenizer_path)

        def decode_tokens(ids: list[int]) -> str:
            return slow.decode(ids, skip_special_tokens=False)

    decode_tokens([0])  # warm up the decode path too
    return decode_tokens


def _cleans_up_spaces(tokenizer_path: str) -> bool:
    config_path = os.path.join(tokenizer_path, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return False
    with open(config_path) as f:
        return bool(json.load(f).get("clean_up_tokenization_spaces"))


class SchedulerLoop:
    """The event loop around one `Scheduler`; handlers are dispatched by message type."""

    def __init__(self, config: AerieConfig, replica: int = 0) -> None:
        """replica: the data-parallel replica this scheduler plans for (its own worker)."""
        model_path = config.model.model_path
        assert model_path is not None and config.cache.max_total_tokens is not None
        self.core = Scheduler(
            config,
            eos_token_ids=read_model_info(model_path).eos_token_ids,
            max_total_tokens=config.cache.max_total_tokens,
            decode_tokens=load_decoder(config.model.tokenizer_path or model_path),
        )
        self.replica, self.name = replica, endpoints.scheduler_name(replica)
        self.inbox = Receiver(endpoints.inbox(config, self.name))
        # The worker listens on its link before it reports ready, and the launcher starts the
        # schedulers after the workers are ready.
        self.to_worker = StepLink.connect(
            endpoints.step_link(config, replica), timeout_s=config.server.startup_timeout_s
        )
        self.messages = Inbox(self.to_worker, self.inbox)  # results first
        self.to_frontends = [
            Sender(endpoints.inbox(config, name)) for name in endpoints.frontend_names(config)
        ]
        self.applied: list[StepOutputs] = []  # from results, sent after the next plan
        self.trace = StepTrace.from_env(self.name)  # AERIE_STEP_TRACE (benchmarks only)
        self.traced_results: list[int] = []  # plan ids of the results behind `applied`
        self.host_profile = HostProfile.from_env(self.name)  # AERIE_HOST_PROFILE (the same)
        self.running = True
        self.progress = Progress()
        self.stalled = False  # has work, but no plan could be made
        self._last_stats: SchedulerStats | None = None
        self._last_stats_time = 0.0
        self._handlers: dict[type, Callable[[Any], None]] = {
            TokenizedRequest: self.core.add_request,
            AbortRequest: lambda msg: self.core.abort(msg.rid),
            StepResult: self.handle_result,
            Shutdown: self.handle_shutdown,
            DebugQuery: self.handle_debug_query,
        }

    def handle_result(self, result: StepResult) -> None:
        """Apply it; its deltas stay queued until the next plan has been sent (`step`)."""
        plan = self.core.oldest_in_flight
        if plan is None:
            raise RuntimeError(f"StepResult {result.plan_id} arrived with no plan in flight")
        if self.trace is not None:
            self.trace.mark("result_in", result.plan_id)
        self.applied += self.core.apply_result(plan, result)
        if self.trace is not None:
            self.trace.mark("applied", result.plan_id)
            self.traced_results.append(result.plan_id)

    def handle_debug_query(self, msg: DebugQuery) -> None:
        if msg.flush_cache:
            logger.info("flushed %d cached tokens", self.core.flush_cache())
        summary, requests = self.core.describe(check_kv=msg.flush_cache)
        summary = {**summary, "stalled": self.stalled}
        report = DebugReport(msg.query_id, self.replica, summary, requests)
        self.to_frontends[msg.frontend].send(report)

    def handle_shutdown(self, msg: Shutdown) -> None:
        logger.info("shutting down (%s)", msg.reason or "no reason given")
        self.running = False
        if self.trace is not None:
            self.trace.write()
        if self.host_profile is not None:
            self.host_profile.write()

    def dispatch(self, message: Any) -> None:
        handler = self._handlers.get(type(message))
        if handler is None:
            raise TypeError(f"scheduler cannot handle {type(message).__name__}")
        handler(message)

    def run(self) -> None:
        while self.running:
            idle = not self.core.can_plan() or not self.core.has_work() or self.stalled
            # With a step in flight its result comes within milliseconds: spin for it.
            spin_s = RESULT_SPIN_S if self.core.num_in_flight else 0.0
            first = None
            if idle:
                self.progress.end()
                first = self.messages.recv(timeout_s=STATS_INTERVAL_S, spin_s=spin_s)
            self.progress.begin("a scheduling pass")
            messages = ([first] if first is not None else []) + self.messages.drain()
            self.stalled = self.stalled and not messages
            for message in messages:
                self.dispatch(message)
                if not self.running:
                    return
            self.step()

    def step(self) -> None:
        """Send plans while fewer than max_in_flight are in flight, then the queued outputs,
        then stats when due."""
        while self.core.can_plan() and self.core.has_work() and not self.stalled:
            plan = self.core.next_plan()
            if plan is None:
                self.stalled = True  # wait for a message (a result, a request) to try again
                break
            if self.trace is not None:
                self.trace.mark("plan_out", plan.plan_id)
                # A speculative iteration is traced as "speculate", a plain decode step as "decode".
                mode = "speculate" if plan.mode == "decode" and plan.speculate else plan.mode
                self.trace.plan(plan.plan_id, mode, len(plan.rows) // 4)  # int32 rows
            self.to_worker.send(plan)
            if self.host_profile is not None:
                self.host_profile.at(plan.plan_id)
        self.applied += self.core.take_outputs()
        if self.applied:
            self.send_outputs(self.applied)
            self.applied = []
        self.send_stats()
        if self.trace is not None:
            for plan_id in self.traced_results:
                self.trace.mark("done", plan_id)
            self.traced_results = []

    def send_outputs(self, outputs: list[StepOutputs]) -> None:
        """Each message to its frontend (from results applied in one pass there may be two
        messages for a frontend: they go in order)."""
        for message in outputs:
            self.to_frontends[message.frontend].send(message)

    def send_stats(self) -> None:
        stats = dataclasses.replace(self.core.stats(), replica=self.replica)
        now = time.monotonic()
        last = self._last_stats
        changed = last is None or (last.num_running, last.num_waiting) != (
            stats.num_running,
            stats.num_waiting,
        )
        # Once idle (nothing to run, nothing in flight) the last step's frees are reported at
        # once: /server_info must read kv_used_tokens == 0 as soon as the engine is idle.
        idle = not self.core.has_work() and not self.core.num_in_flight
        due = now - self._last_stats_time >= STATS_INTERVAL_S or idle
        if changed or (due and stats != last):
            for frontend in self.to_frontends:
                frontend.send(stats)
            self._last_stats, self._last_stats_time = stats, now

    def close(self) -> None:
        for socket in (self.inbox, self.to_worker, *self.to_frontends):
            socket.close()


def run_loop(loop: SchedulerLoop) -> None:
    try:
        loop.run()
    finally:
        loop.close()


def run_scheduler_process(config: AerieConfig, replica: int = 0) -> None:
    """Entry point of the scheduler child process of a replica (see `aerie.process.run_process`)."""
    run_process(
        endpoints.scheduler_name(replica),
        config,
        build=lambda config: SchedulerLoop(config, replica),
        loop=run_loop,
        ready_info=lambda loop: {
            "max_total_tokens": loop.core.allocator.num_total_tokens,
            "decode_alloc_len": loop.core.policy.decode_alloc_len,
        },
    )
