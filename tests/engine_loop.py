"""Drive a real `Scheduler` and `GPUWorker` in one process the way their processes do: up to
`Scheduler.max_in_flight` plans launched before the oldest result is applied (the overlap
schedule, unless the config disables it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from aerie.messages import ForwardPlan, StepOutputs, StepResult
from aerie.outputs import RequestOutput, read_outputs
from gpu_worker.worker import GPUWorker, Launched
from scheduler_proc.scheduler import Scheduler

OnResult = Callable[[ForwardPlan, StepResult, list[RequestOutput]], None]


def outputs_of(messages: list[StepOutputs]) -> list[RequestOutput]:
    """Every request's outputs in a step's messages."""
    return [out for message in messages for out in read_outputs(message)]


def drive(sched: Scheduler, worker: GPUWorker, on_result: OnResult | None = None) -> int:
    """Run until the scheduler is idle; on_result(plan, result, outputs) after each result is
    applied (outputs: every request's, read from the step's StepOutputs). Returns the number
    of plans run. Checks that no row or KV leaked."""
    launched: deque[tuple[ForwardPlan, Launched]] = deque()
    num_plans = 0
    while sched.has_work() or launched:
        while sched.can_plan() and sched.has_work():
            plan = sched.next_plan()
            if plan is None:
                break
            launched.append((plan, worker.launch(plan)))
            num_plans += 1
        assert launched, "the scheduler has work but made no plan"
        plan, step = launched.popleft()
        result = worker.finish(step)
        messages = sched.apply_result(plan, result)
        if on_result is not None:
            on_result(plan, result, outputs_of(messages))
    assert sched.allocator.is_whole(), "rows or KV leaked"
    return num_plans
