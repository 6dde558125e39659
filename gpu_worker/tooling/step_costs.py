"""Start-up measurement of the step costs adaptive speculation compares (`aerie.step_costs`).

A plain decode step and an iteration, greedy and sampled, per graph bucket: replays launched
back to back as the overlap schedule runs them, timed with device events on the dummy row 0.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from aerie.step_costs import StepCosts
from gpu_worker.graphs.stage_graph import StageGraph
from gpu_worker.step.plan_arrays import EMPTY

if TYPE_CHECKING:
    from gpu_worker.worker import GPUWorker

log = logging.getLogger(__name__)

EAGER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # measured without graphs (up to the rows there are)
# The worker's step variants behind each cost variant: plain decode's, the accept stage's.
PLAIN_VARIANT = {"greedy": "greedy", "sampled": "sample"}
ACCEPT_VARIANT = {"greedy": None, "sampled": "sample"}


def cost_buckets(worker: GPUWorker) -> list[int]:
    assert worker.decode_step is not None
    stage = worker.decode_step.stages["greedy"]
    if isinstance(stage, StageGraph):
        return list(stage.buckets)
    return [b for b in EAGER_BUCKETS if b <= worker.max_running_requests] or [1]


@torch.inference_mode()
def measure_step_costs(worker: GPUWorker, repeats: int = 10, warmup: int = 3) -> StepCosts:
    """Milliseconds per step at each bucket, for `worker` (speculative, with its plain step)."""
    spec, step = worker.spec, worker.decode_step
    assert spec is not None and step is not None, "a speculative worker with a plain step"
    buckets = cost_buckets(worker)
    plain = {name: [] for name in PLAIN_VARIANT}
    speculative = {name: [] for name in ACCEPT_VARIANT}
    began = time.perf_counter()
    for bs in buckets:
        rows_cpu = np.zeros(bs, dtype=np.int64)
        rows = torch.zeros(bs, dtype=torch.int64, device=worker.device)
        for name in PLAIN_VARIANT:
            plain_step = functools.partial(step, rows_cpu, EMPTY, EMPTY, PLAIN_VARIANT[name])
            iteration = functools.partial(spec.iterate, rows, [0] * bs, ACCEPT_VARIANT[name])
            plain[name].append(_time(worker.device, repeats, warmup, plain_step))
            speculative[name].append(_time(worker.device, repeats, warmup, iteration))
    costs = StepCosts(
        tuple(buckets),
        {k: tuple(v) for k, v in plain.items()},
        {k: tuple(v) for k, v in speculative.items()},
    )
    log.info(
        "adaptive speculation: step costs measured in %.1f s; break-even accept length "
        "%.2f greedy, %.2f sampled at batch 1, %.2f / %.2f at %d",
        time.perf_counter() - began,
        costs.break_even(1, False),
        costs.break_even(1, True),
        costs.break_even(buckets[-1], False),
        costs.break_even(buckets[-1], True),
        buckets[-1],
    )
    return costs


def _time(device: torch.device, repeats: int, warmup: int, run) -> float:
    """Milliseconds per call of run(), calls queued back to back."""
    for _ in range(warmup):
        run()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(repeats):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats
    began = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - began) * 1e3 / repeats
