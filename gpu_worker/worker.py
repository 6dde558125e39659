"""`GPUWorker`: the socket-free core of the GPU worker process.

It owns what `build.build_models` makes (the target runner, any drafts and the speculative
worker, `SamplingState`) and the per-row `RowState`. A step is split so the next one can be
queued before it is done: `launch(plan)` writes the plan's slots into every runner's table,
queues the step on the device and starts the copy of its results; `finish` waits for that copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from aerie import codec
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, RequestStart, StepResult
from aerie.step_costs import StepCosts
from aerie.step_trace import StepTrace
from gpu_worker.build import (
    build_models,
    eager_rows_warning,
    graph_max_bs,
    prefill_graph_tokens,
)
from gpu_worker.graphs.forward_graph import PrefillGraphs
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.speculative.target_verify import SpecStepOutput
from gpu_worker.step.decode_step import DecodeStep
from gpu_worker.step.host_batch import HostCopy, PendingCopy, Staging, int64_entries
from gpu_worker.step.plan_arrays import EMPTY, PlanArrays, parse_plan

log = logging.getLogger(__name__)

PLAN_MODES = ("extend", "decode")


@dataclass
class Launched:
    """A step whose work is queued: `pack` turns its copied results into the StepResult."""

    plan_id: int
    copy: PendingCopy | None
    pack: Callable[[list[np.ndarray]], StepResult]

    def ready(self) -> bool:
        """Whether `GPUWorker.finish` would return without waiting."""
        return self.copy is None or self.copy.ready()


class GPUWorker:
    def __init__(self, config: AerieConfig, tp: TensorParallel = SINGLE) -> None:
        """config: resolved (model_path a local directory; device and dtype concrete). tp: this
        worker's tensor-parallel rank; every rank runs every plan (see `gpu_worker.parallel`)."""
        self.config, self.tp = config, tp
        models = build_models(config, tp)
        self.runner, self.draft_runner_list = models.target, models.draft_runner_list
        self.runners = [self.runner, *self.draft_runner_list]
        widths = {runner.req_to_token_pool.max_context_len for runner in self.runners}
        assert len(widths) == 1, f"req_to_token tables of different widths {widths}"
        self.sampling, self.spec, self.rows = models.sampling, models.speculative, models.rows
        self.device = self.runner.device
        self.max_running_requests = self.runner.max_running_requests
        warning = eager_rows_warning(config, self.device.type)
        if warning is not None:
            log.warning(warning)
        # Plain decoding, and the plain steps of adaptive speculation (a speculative iteration
        # runs its own stages).
        self.decode_step: DecodeStep | None = None
        if self.spec is None or config.speculative.adaptive:
            self.decode_step = DecodeStep(
                self.runner,
                self.rows,
                self.sampling,
                graph_max_bs(config),
                [runner.req_to_token_pool for runner in self.runners],
                config.speculative.decode_alloc_len,
                graph_pool=self.spec.graph_pool if self.spec is not None else None,
            )
        # Short prefills replay graphs where they can be captured (the speculative draft's
        # prefill reads the target's hidden states, so they are kept with a draft).
        self.prefill_graphs: PrefillGraphs | None = None
        backend = self.runner.attn_backend
        if (
            prefill_graph_tokens(config) > 0
            and self.device.type == "cuda"
            and backend.supports_cuda_graph
        ):
            self.prefill_graphs = PrefillGraphs(
                self.runner,
                prefill_graph_tokens(config),
                capture=True,
                keep_hidden=self.spec is not None,
            )
        # Per request row: whether its request asked for logprobs (host side).
        self.return_logprob = np.zeros(self.max_running_requests + 1, dtype=bool)
        self.staging = Staging(self.device)  # the step's inputs go over in one copy
        self.trace: StepTrace | None = None  # set by the worker process (AERIE_STEP_TRACE)
        self.results = HostCopy(self.device)  # and its results come back in one
        self.step_costs: StepCosts | None = None  # measured for adaptive speculation

    def info(self) -> dict[str, int | float | str]:
        """What the launcher and scheduler need to know (sent in ProcessReady)."""
        costs = (
            {} if self.step_costs is None else {"speculative_step_costs": self.step_costs.to_json()}
        )
        return {
            **costs,
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "vocab_size": self.runner.vocab_size,
            "context_length": self.runner.context_length,
            "page_size": self.runner.page_size,
            "device": str(self.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
        }

    def execute(self, plan: ForwardPlan) -> StepResult:
        """Run one scheduler step to the end; returns the new tokens in plan order."""
        return self.finish(self.launch(plan))

    def finish(self, launched: Launched) -> StepResult:
        """Wait for a launched step's results and pack them (steps finish in launch order)."""
        return launched.pack(launched.copy.wait() if launched.copy is not None else [])

    @torch.inference_mode()
    def launch(self, plan: ForwardPlan) -> Launched:
        """Queue one scheduler step on the device (see the module docstring)."""
        if plan.mode not in PLAN_MODES:
            raise ValueError(f"unknown plan mode {plan.mode!r}")
        arrays = parse_plan(plan, self.max_running_requests)
        for start in plan.starts:
            self._start_request(start)
        if arrays.batch_size == 0:
            empty = StepResult(plan_id=plan.plan_id, num_tokens=b"", token_ids=b"")
            return Launched(plan.plan_id, None, lambda _: empty)
        self._mark("parsed", plan.plan_id)
        if plan.mode == "decode" and (self.spec is None or not plan.speculate):
            if self.decode_step is None:
                raise ValueError(
                    "a plain decode plan for a speculative worker built without "
                    "--speculative-adaptive on"
                )
            return self._launch_decode(plan.plan_id, arrays)  # (its stage records the slots)
        rows = self._write_slots(arrays)
        self._mark("slots_written", plan.plan_id)
        if plan.mode == "extend":
            return self._launch_extend(plan.plan_id, arrays, rows)
        return self._launch_speculative(plan.plan_id, arrays, rows)

    # ------------------------------------------------------------------------------ modes

    def _launch_extend(self, plan_id: int, arrays: PlanArrays, rows: torch.Tensor) -> Launched:
        host = arrays.extend_batch()
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(host):
            batch, out = self.prefill_graphs.run(host)
        else:
            batch = host.to_device(self.device, self.runner.staging)
            out = self.runner.forward(batch)
        sampled_ids, next_ids = self.staging.upload(
            [arrays.sample.astype(np.int64), arrays.next_input_ids]
        )
        sampled = sampled_ids.bool()
        positions = batch.seq_lens  # the position of each request's next token
        want = bool(self.return_logprob[arrays.rows[arrays.sample]].any())
        token_ids, logprobs = self.sampling.sample(
            out.next_token_logits, rows, positions, want, rows_cpu=arrays.rows
        )
        if arrays.sample.any():
            self.sampling.observe(rows, token_ids, weights=sampled_ids)
        self.rows.commit_extend(rows, batch.seq_lens, token_ids, sampled)
        if self.spec is not None:
            # The draft's tail: the next prompt token for a non-final chunk, else the sample. A
            # new row assigned slots before its chunk starts on a cached prefix.
            tails = torch.where(next_ids >= 0, next_ids, token_ids)
            cached_start = arrays.slot_starts < arrays.committed_lens
            self.spec.draft_prefill(batch, out, tails, arrays.rows, cached_start)
        copy = self.results.start(token_ids, *([logprobs] if logprobs is not None else []))
        keep = arrays.sample  # host mask: requests that sampled this step

        def pack(fetched: list[np.ndarray]) -> StepResult:
            return StepResult(
                plan_id=plan_id,
                num_tokens=codec.pack_ids(keep.astype(np.int32)),
                token_ids=codec.pack_ids(fetched[0][keep]),
                logprobs=codec.pack_floats(fetched[1][keep]) if len(fetched) > 1 else b"",
            )

        return Launched(plan_id, copy, pack)

    def _launch_decode(self, plan_id: int, arrays: PlanArrays) -> Launched:
        """Plain decoding: the step's rows and new slots go over in the one copy into the
        decode stage's inputs, which records the slots and runs the step (one replay)."""
        step = self.decode_step
        assert step is not None
        want = bool(self.return_logprob[arrays.rows].any())
        variant = step.variant_for(arrays.rows, want)
        index = self.runner.req_to_token_pool.flat_index(*arrays.slot_positions())
        slots = arrays.slots
        capacity = step.slot_capacity(arrays.batch_size)
        if capacity is not None and len(slots) > capacity:  # more than its bucket takes
            self._write_slots(arrays, index)
            index, slots = EMPTY, EMPTY
        self._mark("slots_written", plan_id)
        out = step(arrays.rows, index, slots, variant)  # samples, counts, commits each token
        self._mark("stepped", plan_id)
        token_ids, logprobs = out.tokens, out.logprobs if want else None
        copy = self.results.start(token_ids, *([logprobs] if logprobs is not None else []))
        bs = arrays.batch_size

        def pack(fetched: list[np.ndarray]) -> StepResult:
            return StepResult(
                plan_id=plan_id,
                num_tokens=codec.pack_ids(np.ones(bs, dtype=np.int32)),
                token_ids=codec.pack_ids(fetched[0]),
                logprobs=codec.pack_floats(fetched[1]) if len(fetched) > 1 else b"",
            )

        return Launched(plan_id, copy, pack)

    def _launch_speculative(self, plan_id: int, arrays: PlanArrays, rows: torch.Tensor) -> Launched:
        assert self.spec is not None
        want = bool(self.return_logprob[arrays.rows].any())
        if self.runner.attn_backend.reads_host_lengths:  # a device read: the reference
            committed_lens_cpu = self.rows.committed_lens[rows].tolist()
        else:
            committed_lens_cpu = [0] * arrays.batch_size  # placeholders (see `reads_host_lengths`)
        copy: PendingCopy | None = None

        def accepted(out: SpecStepOutput) -> None:
            """Runs once acceptance is queued, before the draft extend: the results go to the
            host and the scheduler can plan while the draft runs."""
            nonlocal copy
            self.sampling.observe(rows, out.tokens, lengths=out.accept_lens)
            extra = [out.logprobs] if out.logprobs is not None else []
            copy = self.results.start(out.accept_lens, out.tokens, *extra)

        self.spec.decode(rows, arrays.rows, committed_lens_cpu, want, on_accepted=accepted)
        bs = arrays.batch_size

        def pack(fetched: list[np.ndarray]) -> StepResult:
            accept_lens, tokens, *logprobs = fetched
            width = tokens.size // bs
            keep = (np.arange(width)[None, :] < accept_lens[:, None]).flatten()
            return StepResult(
                plan_id=plan_id,
                num_tokens=codec.pack_ids(accept_lens),
                token_ids=codec.pack_ids(tokens[keep]),
                logprobs=codec.pack_floats(logprobs[0][keep]) if logprobs else b"",
                num_verify=codec.pack_ids(np.ones(bs, dtype=np.int32)),
            )

        return Launched(plan_id, copy, pack)

    # ------------------------------------------------------------------------------ helpers

    def _mark(self, event: str, plan_id: int) -> None:
        """A point inside a launch for the step trace (`aerie.step_trace`), when one is on."""
        if self.trace is not None:
            self.trace.mark(event, plan_id)

    def _start_request(self, start: RequestStart) -> None:
        if not 0 < start.row <= self.max_running_requests:
            raise ValueError(f"RequestStart for invalid request row {start.row}")
        self.sampling.start(
            start.row,
            start.sampling,
            codec.unpack_ids(start.prompt_ids),
            start.output_len,
        )
        self.return_logprob[start.row] = start.return_logprob

    def _write_slots(self, arrays: PlanArrays, flat: np.ndarray | None = None) -> torch.Tensor:
        """Record every assigned slot (headroom included) in every runner's req_to_token rows
        (all of one shape), uploading the step's rows in the same copy, the slots already as
        the tables' int32; returns the rows [bs] on the device. flat: the slots' flat indices
        (`ReqToTokenPool.flat_index`), when the caller has them."""
        if flat is None:
            flat = self.runner.req_to_token_pool.flat_index(*arrays.slot_positions())
        rows, index, packed = self.staging.upload(
            [arrays.rows, flat, int64_entries(arrays.slots, 4)]
        )
        if len(flat):
            slots = packed.view(torch.int32)[: len(flat)]
            for runner in self.runners:
                runner.req_to_token_pool.assign(index, slots)
        return rows
