"""Where a speculative iteration's time goes: each stage (propose, accept, extend) run as
`SpeculativeWorker.iterate` runs it, but synchronised and timed alone from the same saved
per-row state. What a served iteration costs beyond their sum is the host's (and, for greedy
trees, the compaction between propose and extend).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from aerie.messages import ForwardPlan
from gpu_worker.step.plan_arrays import parse_plan
from gpu_worker.worker import GPUWorker


class _Timed:
    """A stage that, called, runs synchronised and adds its milliseconds to totals[name]."""

    def __init__(self, stage, name: str, totals: dict[str, float], device: torch.device):
        self.stage, self.name, self.totals, self.device = stage, name, totals, device

    def __call__(self, *args):
        if self.device.type != "cuda":
            began = time.perf_counter()
            out = self.stage(*args)
            self.totals[self.name] += (time.perf_counter() - began) * 1e3
            return out
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        torch.cuda.synchronize(self.device)
        start.record()
        out = self.stage(*args)
        end.record()
        end.synchronize()
        self.totals[self.name] += start.elapsed_time(end)
        return out


@torch.inference_mode()
def stage_split(
    worker: GPUWorker, plan: ForwardPlan, restore: Callable[[], None], iters: int = 20
) -> dict[str, float]:
    """Milliseconds of each stage of `plan`'s iteration (a decode plan the worker has run, so
    its slots are recorded), over `iters` iterations (`SpeculativeWorker.iterate`), each from
    the state `restore` puts back: propose_ms, accept_ms (0 where the batch accepts inside
    the propose stage) and extend_ms, and their sum. Each stage runs synchronised before and
    after, so nothing overlaps it."""
    spec = worker.spec
    assert spec is not None, "a speculative worker"
    arrays = parse_plan(plan, worker.max_running_requests)
    rows = torch.as_tensor(arrays.rows, device=worker.device)
    variant = spec.accept_variant(arrays.rows, False)
    committed_lens_cpu = worker.rows.committed_lens[rows].tolist()
    totals = {"propose_ms": 0.0, "accept_ms": 0.0, "extend_ms": 0.0}
    stages = dict(spec.propose_stages), spec.extend_stage, dict(spec.accept_stages)
    spec.propose_stages = {
        name: _Timed(stage, "propose_ms", totals, worker.device)
        for name, stage in stages[0].items()
    }
    spec.extend_stage = _Timed(stages[1], "extend_ms", totals, worker.device)
    spec.accept_stages = {
        name: _Timed(stage, "accept_ms", totals, worker.device) for name, stage in stages[2].items()
    }
    try:
        for _ in range(iters):
            restore()
            spec.iterate(rows, committed_lens_cpu, variant)
    finally:
        spec.propose_stages, spec.extend_stage, spec.accept_stages = stages
        restore()
    split = {name: ms / iters for name, ms in totals.items()}
    return {**split, "stages_ms": sum(split.values())}
