"""`run_gpu_worker_process`: moves messages between the scheduler and the `GPUWorker` core.

Plans arrive on the step link and are launched at once; launched steps are finished in order
and their results sent back, so the next plan is queued behind the running step. With tensor
parallelism rank 0 forwards each plan and Shutdown to the other ranks before launching it;
only rank 0 has a step link and reports results.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from aerie import codec, endpoints
from aerie.config import AerieConfig
from aerie.host_profile import HostProfile
from aerie.messages import ForwardPlan, Shutdown, StepResult
from aerie.process import Progress, run_process
from aerie.step_trace import StepTrace
from aerie.transport import Inbox, Receiver, Sender, StepLink
from gpu_worker.parallel import TensorParallel, init_tensor_parallel
from gpu_worker.tooling.step_costs import measure_step_costs
from gpu_worker.tooling.step_profile import StepClock, StepProfiler
from gpu_worker.tooling.warm_up import run_warm_up, watch_compiles
from gpu_worker.worker import GPUWorker, Launched

log = logging.getLogger(__name__)

IDLE_CHECK_S = 2.0  # how often an idle rank on another machine checks that rank 0 is alive


class WorkerLoop:
    """The worker core of one tensor-parallel rank plus its sockets (inbox bound before
    readiness is reported)."""

    def __init__(self, config: AerieConfig, rank: int = 0, replica: int = 0) -> None:
        """rank: in the tensor-parallel group of data-parallel replica `replica`."""
        config = config.replace(model={"device": worker_device(config, rank, replica)})
        # AERIE_PROFILE_STEPS (benchmarks only): the device of replica 0's rank 0, traced from
        # before the worker captures its graphs (see StepProfiler); one file, one writer.
        self.profiler = StepProfiler.from_env() if rank == 0 and replica == 0 else None
        self.worker = GPUWorker(config, join_group(config, rank, replica))
        self.progress = Progress(describe_step)
        if self.worker.device.type == "cuda":  # the interpreter on CPU compiles nothing
            seconds = run_warm_up(self.worker)
            if seconds is not None:
                log.info("start-up warm-up: prefill kernels compiled in %.1f s", seconds)
            spec = config.speculative
            if spec.adaptive and not spec.speculative_step_costs:
                self.worker.step_costs = measure_step_costs(self.worker)
            watch_compiles(on_build=self.progress.advance)
        else:
            watch_layers(self.worker, self.progress.advance)
        self.name = endpoints.worker_name(rank, replica)
        self.inbox = Receiver(endpoints.inbox(config, self.name))
        # A rank on another machine than rank 0 also listens where rank 0 can reach it.
        on_node_zero = config.parallel.node_rank == 0
        remote = None if on_node_zero else endpoints.remote_inbox_address(config)
        address = self.inbox.bind(remote) if remote is not None else self.inbox.address
        # Rank 0 reports to its replica's scheduler and forwards plans to the other ranks, at
        # the addresses they bound (tcp:// on other machines with --nnodes).
        addresses = self.worker.tp.gather_objects(address)
        # Rank 0's step link, listening before readiness is reported (the scheduler, started
        # once the workers are ready, connects to it).
        self.link = StepLink.listen(endpoints.step_link(config, replica)) if rank == 0 else None
        self.messages = Inbox(self.link, self.inbox) if self.link is not None else Inbox(self.inbox)
        others = addresses[1:] if rank == 0 else []
        self.followers = [Sender(str(address)) for address in others]
        # A rank on another machine than rank 0 is not stopped by node 0's launcher: when idle
        # it checks every IDLE_CHECK_S that rank 0 still holds the group's meeting address.
        self.rank_zero_address = None if on_node_zero else endpoints.init_address(config, replica)
        self.next_check = 0.0
        # Start-up is over: from now on a collective that waits this long means a dead peer.
        self.worker.tp.start_serving()
        self.running = True
        # Launched steps, each with its plan and when its launch began (what heartbeats report).
        self.launched: deque[tuple[Launched, ForwardPlan, float]] = deque()
        # AERIE_STEP_TRACE (benchmarks only): rank 0's host timestamps of every step.
        self.trace = StepTrace.from_env(self.name) if rank == 0 else None
        self.worker.trace = self.trace
        # AERIE_HOST_PROFILE (benchmarks only): rank 0's Python profile over a window of plans.
        self.host_profile = HostProfile.from_env(self.name) if rank == 0 else None
        on_cuda = self.worker.device.type == "cuda"
        self.clock = StepClock() if self.trace is not None and on_cuda else None
        self.handlers: dict[type, Callable[[Any], None]] = {
            ForwardPlan: self.handle_plan,
            Shutdown: self.handle_shutdown,
        }

    def check_rank_zero(self) -> None:
        """On another machine than rank 0: every IDLE_CHECK_S, fail if rank 0 no longer holds
        the group's meeting address."""
        address = self.rank_zero_address
        if address is None or time.monotonic() < self.next_check:
            return
        if not rank_zero_alive(address):
            raise RuntimeError(
                f"tensor-parallel rank 0 (node 0, {address}) is gone: the server on node 0 "
                "stopped or its machine is unreachable"
            )
        self.next_check = time.monotonic() + IDLE_CHECK_S

    def forward(self, message: ForwardPlan | Shutdown) -> None:
        """Pass a message on to the other ranks (encoded once for all of them)."""
        if self.followers:
            data = codec.encode(message)
            for follower in self.followers:
                follower.send_encoded(data)

    def handle_plan(self, plan: ForwardPlan) -> None:
        if self.trace is not None:
            self.trace.mark("plan_in", plan.plan_id)
        if self.host_profile is not None:
            self.host_profile.at(plan.plan_id)
        started = time.monotonic()
        self.progress.begin((plan, ON_HOST), started)
        self.forward(plan)
        if self.profiler is not None:
            self.profiler.on_launch(plan.mode, len(plan.rows) // 4)
        if self.clock is not None:
            self.clock.begin(plan.plan_id)
        self.launched.append((self.worker.launch(plan), plan, started))
        self.report_oldest()
        if self.clock is not None:
            self.clock.end(plan.plan_id)
        if self.trace is not None:
            self.trace.mark("launched", plan.plan_id)

    def report_oldest(self) -> None:
        """Progress: the oldest launched step, waiting for the device; idle when none is."""
        if not self.launched:
            self.progress.end()
            return
        _, plan, started = self.launched[0]
        self.progress.begin((plan, ON_DEVICE), started)

    def record_device_time(self, plan_id: int) -> None:
        """The finished step's device gap and span (`StepClock`) into the trace."""
        if self.clock is None or self.trace is None:
            return
        gap, span = self.clock.finished(plan_id)
        if gap is not None:
            self.trace.value("gpu_gap_us", plan_id, gap)
        self.trace.value("gpu_span_us", plan_id, span)

    def handle_shutdown(self, message: Shutdown) -> None:
        self.forward(message)
        # Steps already launched run to their end on every rank (their collectives meet).
        while self.launched:
            self.finish_oldest()
        self.running = False

    def finish_oldest(self) -> StepResult:
        """Wait for the oldest launched step's result; progress moves on to the next one."""
        result = self.worker.finish(self.launched.popleft()[0])
        self.report_oldest()
        return result

    def run(self) -> None:
        while self.running:
            if not self.launched:
                wait_s = None if self.rank_zero_address is None else IDLE_CHECK_S
                message = self.messages.recv(timeout_s=wait_s)
                if message is not None:
                    self.dispatch(message)
                self.check_rank_zero()
                continue
            # A step is on the device: take the next plan if one came, else send the oldest
            # result as soon as it is ready (polling both: a step lasts a millisecond or two).
            message = self.messages.recv(timeout_s=0)
            if message is not None:
                self.dispatch(message)
            elif self.launched[0][0].ready():
                if self.trace is not None:
                    self.trace.mark("ready", self.launched[0][0].plan_id)
                result = self.finish_oldest()
                if self.trace is not None:
                    self.trace.mark("result_out", result.plan_id)
                if self.link is not None:
                    self.link.send(result)
                self.record_device_time(result.plan_id)
                if self.profiler is not None:
                    self.profiler.on_finish()
        if self.trace is not None:
            self.trace.write()
        if self.host_profile is not None:
            self.host_profile.write()
        self.inbox.close()
        if self.link is not None:
            self.link.close()
        for sender in self.followers:
            sender.close()

    def dispatch(self, message: Any) -> None:
        handler = self.handlers.get(type(message))
        if handler is None:
            raise TypeError(f"gpu_worker got an unexpected message {type(message).__name__}")
        handler(message)


ON_HOST, ON_DEVICE = "on the host", "on the device"


def watch_layers(worker: GPUWorker, on_layer: Callable[[], None]) -> None:
    """Call on_layer after every layer forward of every model the worker runs (the members of
    its models' ModuleLists). For a CPU worker only: there a step's whole computation runs in
    its launch, for minutes with a long prompt, and a layer done is progress; on CUDA a layer's
    forward only queues its kernels, and the hooks would slow every launch."""
    for runner in worker.runners:
        for module in runner.model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_hook(lambda *_: on_layer())


def describe_step(step: tuple[ForwardPlan, str]) -> str:
    """ "step 17 (extend, 7,000 tokens, 1 request) on the host": a step and where it is."""
    plan, where = step
    num_reqs = len(plan.rows) // 4  # int32 rows
    requests = f"{num_reqs} request" + ("s" if num_reqs != 1 else "")
    mode = f"extend, {len(plan.input_ids) // 4:,} tokens" if plan.mode == "extend" else plan.mode
    return f"step {plan.plan_id} ({mode}, {requests}) {where}"


def rank_zero_alive(address: str) -> bool:
    """Whether something accepts connections at rank 0's meeting address (its group's store)."""
    try:
        with socket.create_connection(endpoints.split_host_port(address), timeout=IDLE_CHECK_S):
            return True
    except OSError:
        return False


def worker_device(config: AerieConfig, rank: int, replica: int) -> str:
    """The device of one worker: with several workers on CUDA, GPU replica * tp_size + rank of
    the machine (less the ranks of the machines before it, with --nnodes); else the configured
    device."""
    parallel = config.parallel
    device = config.model.device
    if device == "cuda" and parallel.tp_size * parallel.dp_size > 1:
        first = endpoints.node_ranks(config).start
        return f"cuda:{replica * parallel.tp_size + rank - first}"
    return device


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, e.g. under taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cpu_threads(cores: int, workers: int) -> int:
    """Intra-op threads of each of `workers` CPU workers on `cores` cores: one core is left to
    the scheduler (it polls for every step's result) and the frontends.

    NOTE: more threads than the cores free for them is far slower than fewer, not a little:
    each op ends on a barrier that waits for a descheduled thread (figures in
    docs/reliability.md)."""
    return max(1, (cores - 1) // workers)


def join_group(config: AerieConfig, rank: int, replica: int) -> TensorParallel:
    """Set up this worker's device and threads and join its replica's tensor-parallel group,
    which meets at the port of --dist-init-addr plus the replica's index."""
    parallel = config.parallel
    device = torch.device(config.model.device)
    if device.index is not None:  # "cuda:N": each worker its own GPU
        torch.cuda.set_device(device)
    elif device.type == "cpu":  # the workers share the machine's cores
        workers = parallel.tp_size * parallel.dp_size // parallel.nnodes
        torch.set_num_threads(cpu_threads(usable_cores(), workers))
    if parallel.tp_size == 1:
        return TensorParallel()
    address = endpoints.init_address(config, replica)
    startup = datetime.timedelta(seconds=config.server.startup_timeout_s)
    peer = not parallel.disable_custom_all_reduce
    return init_tensor_parallel(rank, parallel.tp_size, address, device, startup, peer)


def run_gpu_worker_process(config: AerieConfig, rank: int = 0, replica: int = 0) -> None:
    run_process(
        endpoints.worker_name(rank, replica),
        config,
        build=lambda config: WorkerLoop(config, rank, replica),
        loop=lambda core: core.run(),
        ready_info=lambda core: core.worker.info(),
    )
