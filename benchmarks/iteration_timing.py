"""What `bench_speculative.py --mode iteration` times with: one decode plan replayed from the
same per-row state (`Replayer`), served-style runs of it with steps in flight (`run_steps`,
`time_plan`), a spin for a host profiler, CUDA profiles of one step (`profile_plan`), the
host's share of a launch (`host_split`), the bytes bound of an iteration (`byte_bound`) and a
draft that always agrees (`make_agreeing`)."""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections import deque

import torch

from aerie.codec import pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, SamplingParams, TokenizedRequest
from benchmarks.spec_requests import sync
from benchmarks.step_timeline import Interval, between_markers, mean_timeline, step_timeline
from gpu_worker.worker import GPUWorker
from scheduler_proc.scheduler import Scheduler


class Replayer:
    """The first decode plan after prefilling `num` random prompts, run again and again from
    the same per-row state: the worker's committed lengths and last tokens are put back
    before every run (two small copies), so the state never advances."""

    def __init__(
        self,
        worker: GPUWorker,
        config: AerieConfig,
        num: int,
        context_len: int,
        temperature: float = 0.0,
    ) -> None:
        self.worker = worker
        sched = Scheduler(config, (), max_total_tokens=worker.runner.max_total_tokens)
        gen = torch.Generator().manual_seed(0)
        for i in range(num):
            prompt = torch.randint(3, worker.runner.vocab_size, (context_len,), generator=gen)
            params = SamplingParams(
                max_new_tokens=1024, temperature=temperature, seed=i, ignore_eos=True
            )
            sched.add_request(TokenizedRequest(f"r{i}", pack_ids(prompt.tolist()), params))
        while True:
            plan = sched.next_plan()
            if plan.mode == "decode":
                break
            sched.apply_result(plan, worker.execute(plan))
        self.plan = plan
        self.saved = worker.rows.committed_lens.clone(), worker.rows.tokens.clone()

    def restore(self) -> None:
        """The saved per-row state back in place (two copies on the device)."""
        self.worker.rows.committed_lens.copy_(self.saved[0])
        self.worker.rows.tokens.copy_(self.saved[1])

    def execute(self, bs: int | None = None):
        """Run the plan (its first bs requests) from the saved state."""
        self.restore()
        return self.worker.execute(self.plan if bs is None else sub_plan(self.plan, bs))


IN_FLIGHT = 2  # decode steps the worker process keeps queued under the overlap schedule


def run_steps(replay: Replayer, bs: int | None, steps: int, in_flight: int):
    """Run the plan `steps` times from the saved state, each launched once fewer than
    `in_flight` earlier steps are unfinished; returns the last step's result."""
    plan = replay.plan if bs is None else sub_plan(replay.plan, bs)
    worker, pending, result = replay.worker, deque(), None
    for _ in range(steps):
        replay.restore()
        pending.append(worker.launch(plan))
        if len(pending) == in_flight:
            result = worker.finish(pending.popleft())
    while pending:
        result = worker.finish(pending.popleft())
    return result


def time_plan(
    replay: Replayer,
    bs: int | None,
    device: str,
    iters: int,
    in_flight: int = IN_FLIGHT,
    repeats: int = 5,
) -> tuple[float, int]:
    """Seconds per step of the plan for bs requests, and the tokens the last step emitted.

    in_flight=2 is the served step: the worker process launches a step before it finishes the
    one before, so the host's launch and result handling overlap the device's work, and a
    plain step costs what `bench_decode` times with device events. in_flight=1 times a step
    alone (launched, then finished before the next), which adds the host's whole round trip to
    every step: a yardstick no user meets, reported only to show that difference. The median
    of `repeats` loops of `iters` steps."""
    run_steps(replay, bs, 3, in_flight)  # warm-up
    sync(device)
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run_steps(replay, bs, iters, in_flight)
        sync(device)
        times.append((time.perf_counter() - start) / iters)
    return statistics.median(times), sum(unpack_ids(result.num_tokens))


def spin(replay: Replayer, bs: int, name: str, seconds: float) -> None:
    """Run the plan for `seconds` after printing a marker with this process's id, for a host
    profiler to attach to (`python3 -m benchmarks iteration --pyspy-seconds`)."""
    if seconds <= 0:
        return
    print(f"spinning {name} bs={bs} for {seconds} s in pid {os.getpid()}", flush=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        replay.execute(bs)
    sync(replay.worker.device.type)


MARKER = "spin_kernel"  # torch.cuda._sleep's kernel, queued around each profiled step


def profile_plan(replay: Replayer, bs: int, iters: int = 5) -> dict:
    """Per `execute` of the plan, from the profiler (device activity only, so the host runs
    as it does unprofiled): GPU kernels, GPU busy milliseconds, the kernels by name (count and
    microseconds per execute, the most expensive first), and the step's timeline
    (`step_timeline`: GPU span, short and long gaps, the wait for the first kernel; host_us is
    the wall time outside the span; trace: the first step's intervals). A marker kernel
    before and after each step separates them."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    plan = replay.plan if bs is None else sub_plan(replay.plan, bs)
    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            replay.restore()
            torch.cuda.synchronize()
            torch.cuda._sleep(100)  # a marker kernel before the step and one after it
            start = time.perf_counter()
            replay.worker.execute(plan)
            walls.append((time.perf_counter() - start) * 1e6)
            torch.cuda._sleep(100)
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    intervals = [Interval(e.time_range.start, e.time_range.end, e.name) for e in events]
    marker_ends = [i.end for i in sorted(intervals, key=lambda i: i.start) if MARKER in i.name]
    groups = between_markers(intervals, MARKER)
    kernels = [e for e in events if MARKER not in e.name]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    table = [
        {"kernel": name, "count": n / iters, "us": us / iters}
        for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])
    ]
    busy_us = sum(e.device_time for e in kernels)
    timeline = {}
    if len(groups) == iters:
        steps = [step_timeline(g, start=marker_ends[2 * k]) for k, g in enumerate(groups)]
        timeline = mean_timeline(steps)
        timeline["wall_us"] = sum(walls) / iters
        timeline["host_us"] = timeline["wall_us"] - timeline["span_us"]
        first = groups[0]
        timeline["trace"] = [
            [round(i.start - first[0].start, 2), round(i.end - i.start, 2), i.name[:60]]
            for i in first
        ]
    else:  # for a look at why the markers did not pair up
        timeline["unpaired_trace"] = [
            [round(i.start, 2), round(i.end - i.start, 2), i.name[:60]]
            for i in sorted(intervals, key=lambda i: i.start)[:600]
        ]
    return {
        "kernels": len(kernels) / iters,
        "gpu_ms": busy_us / iters / 1e3,
        "table": table,
        "timeline": timeline,
    }


def host_split(replay: Replayer, bs: int, iters: int = 20) -> dict:
    """Where the host's time per `execute` goes (no profiler): `GPUWorker.launch` (of which
    CUDA graph replays: the launch calls themselves) and `finish` (waiting for the results,
    then packing them), in microseconds."""
    plan = replay.plan if bs is None else sub_plan(replay.plan, bs)
    worker, totals = replay.worker, {"launch_us": 0.0, "replay_us": 0.0, "finish_us": 0.0}
    original = torch.cuda.CUDAGraph.replay

    def timed(graph) -> None:
        start = time.perf_counter()
        original(graph)
        totals["replay_us"] += (time.perf_counter() - start) * 1e6

    torch.cuda.CUDAGraph.replay = timed
    try:
        for _ in range(iters):
            replay.restore()
            torch.cuda.synchronize()
            start = time.perf_counter()
            launched = worker.launch(plan)
            queued = time.perf_counter()
            worker.finish(launched)
            totals["launch_us"] += (queued - start) * 1e6
            totals["finish_us"] += (time.perf_counter() - queued) * 1e6
    finally:
        torch.cuda.CUDAGraph.replay = original
    return {key: value / iters for key, value in totals.items()}


def streamed_bytes(model: torch.nn.Module) -> int:
    """Bytes one forward reads from the weights: every parameter once, but the embedding
    table only where it is also the LM head (a lookup reads a few rows)."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed = getattr(model, "embed_tokens", None) or getattr(
        getattr(model, "model", None), "embed_tokens", None
    )
    head = getattr(model, "lm_head", None)
    if embed is not None and (head is None or head.weight.data_ptr() != embed.weight.data_ptr()):
        if embed.weight.data_ptr() in params:
            total -= embed.weight.numel() * embed.weight.element_size()
    return total


def byte_bound(worker: GPUWorker) -> float:
    """1 + (bytes the draft forwards of one iteration read) / (bytes of a target forward): an
    EAGLE draft runs S times (S-1 draft steps and the extend), each MTP layer once."""
    target = streamed_bytes(worker.runner.model)
    drafts = worker.draft_runner_list
    if len(drafts) == 1:
        draft = worker.spec.num_steps * streamed_bytes(drafts[0].model)
    else:
        draft = sum(streamed_bytes(r.model) for r in drafts)
    return 1 + draft / target


def make_agreeing(worker: GPUWorker, max_bs: int) -> None:
    """Turn the random draft into one the target always accepts, then capture again: the
    target's final norm weight 0 (its logits are all 0, argmax token 0); EAGLE drafts map every
    proposal to token 0, MTP layers' final norm weights 0 (argmax 0)."""
    worker.runner.model.model.norm.weight.data.zero_()
    for runner in worker.draft_runner_list:
        if hasattr(runner.model, "final_layernorm"):
            runner.model.final_layernorm.weight.data.zero_()
        else:
            vocab = runner.model.compute_logits(
                torch.zeros(
                    1, runner.config.hidden_size, device=worker.device, dtype=worker.runner.dtype
                )
            ).shape[-1]
            runner.model.hot_token_id = torch.zeros(vocab, dtype=torch.int64, device=worker.device)
    worker.spec.build_stages(worker.runners, max_bs)


def sub_plan(plan: ForwardPlan, bs: int) -> ForwardPlan:
    """The same decode plan for its first bs requests."""
    slot_lens = unpack_ids(plan.slot_lens)[:bs]
    return dataclasses.replace(
        plan,
        rows=plan.rows[: 4 * bs],
        slot_starts=plan.slot_starts[: 4 * bs],
        slot_lens=plan.slot_lens[: 4 * bs],
        slots=plan.slots[: 4 * sum(slot_lens)],
    )
