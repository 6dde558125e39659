"""Where a speculative iteration's time goes: each of its stages run alone.

An iteration is three stages (`gpu_worker.speculative.iteration`): propose (the draft's tree
and the target's verify forward, one CUDA graph), accept (sampled batches only: the accept
stage's graph) and extend (the draft over the accepted tokens, then the rows advance). Here
each runs by itself from the same saved per-row state, synchronised before and after, and is
timed with device events (on CPU, the wall clock): milliseconds per stage. What an iteration
served costs beyond their sum is the host's (launches, the result copy, the gaps between
stages), which `bench_speculative.py --mode iteration` reports as `host_ms`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from aerie.messages import ForwardPlan
from gpu_worker.plan_arrays import parse_plan
from gpu_worker.speculative.iteration import ACCEPT_INPUTS
from gpu_worker.worker import GPUWorker


def _timed(run: Callable[[], object], before: Callable[[], object], device: torch.device,
           iters: int) -> float:  # fmt: skip
    """Milliseconds of run() after before(), each synchronised, averaged over iters."""
    total = 0.0
    for _ in range(iters):
        before()
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            torch.cuda.synchronize(device)
            start.record()
            run()
            end.record()
            end.synchronize()
            total += start.elapsed_time(end)
        else:
            began = time.perf_counter()
            run()
            total += (time.perf_counter() - began) * 1e3
    return total / iters


@torch.inference_mode()
def stage_split(worker: GPUWorker, plan: ForwardPlan, restore: Callable[[], None],
                iters: int = 20) -> dict[str, float]:  # fmt: skip
    """Milliseconds of each stage of `plan`'s iteration (a decode plan the worker has run, so
    its slots are recorded), each from the state `restore` puts back: propose_ms, accept_ms
    (0 where the batch accepts inside the propose stage) and extend_ms, and their sum."""
    spec = worker.spec
    assert spec is not None, "a speculative worker"
    arrays = parse_plan(plan, worker.max_running_requests)
    rows = torch.as_tensor(arrays.rows, device=worker.device)
    variant = spec.accept_variant(arrays.rows, False)
    prefix_cpu = worker.rows.prefix_lens[rows].tolist()
    staged: dict[str, dict] = {}

    def propose():
        staged["proposed"] = spec.propose_stage({"rows": rows}, prefix_cpu)

    def accept():
        proposed = staged["proposed"]
        if variant is None:
            staged["accepted"] = {"accept_lens": proposed["greedy_accept_lens"],
                                  "tokens": proposed["greedy_tokens"],
                                  "features": proposed["greedy_features"]}  # fmt: skip
        else:
            staged["accepted"] = spec.accept_stages[variant](
                {k: proposed[k] for k in ACCEPT_INPUTS}, prefix_cpu)

    def extend():
        proposed, accepted = staged["proposed"], staged["accepted"]
        spec.extend_stage({"rows": proposed["rows"], "prefix_lens": proposed["prefix_lens"],
                           **{k: accepted[k] for k in ("accept_lens", "tokens", "features")}},
                          prefix_cpu)  # fmt: skip

    propose_ms = _timed(propose, restore, worker.device, iters)
    accept_ms = 0.0
    if variant is not None:
        accept_ms = _timed(accept, lambda: (restore(), propose()), worker.device, iters)
    extend_ms = _timed(extend, lambda: (restore(), propose(), accept()), worker.device, iters)
    restore()
    return {"propose_ms": propose_ms, "accept_ms": accept_ms, "extend_ms": extend_ms,
            "stages_ms": propose_ms + accept_ms + extend_ms}  # fmt: skip
