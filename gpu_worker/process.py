"""`run_gpu_worker_process`: moves messages between the scheduler and the `GPUWorker` core.

Loop: ForwardPlan from the inbox -> `GPUWorker.execute` -> StepResult to the scheduler;
Shutdown ends the loop. Handlers are dispatched by message type through a table.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from aerie import endpoints
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, Heartbeat, Shutdown
from aerie.process import HeartbeatResponder, run_process
from aerie.transport import Receiver, Sender
from gpu_worker.worker import GPUWorker


class WorkerLoop:
    """The worker core plus its sockets (inbox bound before readiness is reported)."""

    def __init__(self, config: AerieConfig) -> None:
        if config.model.device != "cuda":
            torch.set_num_threads(os.cpu_count() or 1)
        self.worker = GPUWorker(config)
        self.inbox = Receiver(endpoints.inbox(config, "gpu_worker"))
        self.scheduler = Sender(endpoints.inbox(config, "scheduler"))
        self.running = True
        self.handlers: dict[type, Callable[[Any], None]] = {
            ForwardPlan: self.handle_plan,
            Shutdown: self.handle_shutdown,
            Heartbeat: HeartbeatResponder(config, "gpu_worker"),
        }

    def handle_plan(self, plan: ForwardPlan) -> None:
        self.scheduler.send(self.worker.execute(plan))

    def handle_shutdown(self, message: Shutdown) -> None:
        self.running = False

    def run(self) -> None:
        while self.running:
            message = self.inbox.recv()
            handler = self.handlers.get(type(message))
            if handler is None:
                raise TypeError(f"gpu_worker got an unexpected message {type(message).__name__}")
            handler(message)
        self.inbox.close()
        self.scheduler.close()


def run_gpu_worker_process(config: AerieConfig) -> None:
    run_process(
        "gpu_worker",
        config,
        build=WorkerLoop,
        loop=lambda core: core.run(),
        ready_info=lambda core: core.worker.info(),
    )
