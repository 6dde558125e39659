"""`run_gpu_worker_process`: moves messages between the scheduler and the `GPUWorker` core.

Loop: a ForwardPlan from the inbox is launched at once (`GPUWorker.launch` queues its work on
the device); launched steps are finished in order (`GPUWorker.finish`) and their StepResults
sent to the scheduler. While a step runs on the device the loop keeps reading the inbox, so
the next plan (the scheduler keeps up to two in flight) is queued behind it before it ends:
the device does not wait for the host between steps. Shutdown ends the loop. Handlers are
dispatched by message type through a table.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, Heartbeat, Shutdown
from aerie.process import HeartbeatResponder, run_process
from aerie.transport import Receiver, Sender
from gpu_worker.step_profile import StepProfiler
from gpu_worker.worker import GPUWorker, Launched


class WorkerLoop:
    """The worker core plus its sockets (inbox bound before readiness is reported)."""

    def __init__(self, config: AerieConfig) -> None:
        if config.model.device != "cuda":
            torch.set_num_threads(os.cpu_count() or 1)
        self.worker = GPUWorker(config)
        self.inbox = Receiver(endpoints.inbox(config, "gpu_worker"))
        self.scheduler = Sender(endpoints.inbox(config, "scheduler"))
        self.running = True
        self.launched: deque[Launched] = deque()
        self.profiler = StepProfiler.from_env()  # AERIE_PROFILE_STEPS (benchmarks only)
        self.handlers: dict[type, Callable[[Any], None]] = {
            ForwardPlan: self.handle_plan,
            Shutdown: self.handle_shutdown,
            Heartbeat: HeartbeatResponder(config, "gpu_worker"),
        }

    def handle_plan(self, plan: ForwardPlan) -> None:
        if self.profiler is not None:
            self.profiler.on_launch()
        self.launched.append(self.worker.launch(plan))

    def handle_shutdown(self, message: Shutdown) -> None:
        self.running = False

    def run(self) -> None:
        while self.running:
            if not self.launched:
                self.dispatch(self.inbox.recv())
                continue
            # A step is on the device: take the next plan if one came, else send the oldest
            # result as soon as it is ready (polling both: a step lasts a millisecond or two).
            message = self.inbox.recv(timeout_s=0)
            if message is not None:
                self.dispatch(message)
            elif self.launched[0].ready():
                self.scheduler.send(self.worker.finish(self.launched.popleft()))
                if self.profiler is not None:
                    self.profiler.on_finish()
        self.inbox.close()
        self.scheduler.close()

    def dispatch(self, message: Any) -> None:
        handler = self.handlers.get(type(message))
        if handler is None:
            raise TypeError(f"gpu_worker got an unexpected message {type(message).__name__}")
        handler(message)


def run_gpu_worker_process(config: AerieConfig) -> None:
    run_process(
        "gpu_worker",
        config,
        build=WorkerLoop,
        loop=lambda core: core.run(),
        ready_info=lambda core: core.worker.info(),
    )
