"""`GPUWorker`: the socket-free core of the GPU worker process.

It owns what `build.build_models` makes from the configuration: the target `ModelRunner`; with
speculation the `draft_runner_list` (one EAGLE draft, or one runner per MTP layer) and the
speculative worker that drives them; and the per-row `SamplingState`. `execute(plan)` applies
the scheduler's slot assignments to the req_to_token pool of every runner (all pools address KV
by the same slot ids), runs the step and returns a `StepResult`:
- extend: one target forward; requests on their last chunk sample a token; with speculation
  the draft then runs on the rotated chunk.
- decode: one target forward and a sample per request, or one speculative iteration (draft
  tree, verify, accept, draft extend) that emits 1 .. S+1 tokens per request.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from aerie import codec
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, PlanRequest, StepResult
from gpu_worker.build import build_models
from gpu_worker.forward_batch import ForwardMode
from gpu_worker.host_batch import HostCopy, Staging, segment_offsets
from gpu_worker.plan_arrays import PlanArrays, parse_plan

PLAN_MODES = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE}


class GPUWorker:
    def __init__(self, config: AerieConfig) -> None:
        """config: resolved (model_path a local directory; device and dtype concrete)."""
        self.config = config
        models = build_models(config)
        self.runner, self.draft_runner_list = models.target, models.draft_runner_list
        self.runners = [self.runner, *self.draft_runner_list]
        self.sampling, self.spec = models.sampling, models.speculative
        self.device = self.runner.device
        self.max_running_requests = self.runner.max_running_requests
        # Per request row: whether its request asked for logprobs (host side).
        self.return_logprob = np.zeros(self.max_running_requests + 1, dtype=bool)
        self.staging = Staging(self.device)  # the step's inputs go over in one copy
        self.results = HostCopy(self.device)  # and its results come back in one

    def info(self) -> dict[str, int | float | str]:
        """What the launcher and scheduler need to know (sent in ProcessReady)."""
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "vocab_size": self.runner.vocab_size,
            "context_length": self.runner.context_length,
            "page_size": self.runner.page_size,
            "device": str(self.device),
            "dtype": str(self.runner.dtype).removeprefix("torch."),
        }

    def execute(self, plan: ForwardPlan) -> StepResult:
        """Run one scheduler step; returns the new tokens in plan order."""
        if plan.mode not in PLAN_MODES:
            raise ValueError(f"unknown plan mode {plan.mode!r}")
        if not plan.requests:
            return StepResult(plan_id=plan.plan_id, num_tokens=b"", token_ids=b"")
        for request in plan.requests:
            if request.start is not None:
                self._start_request(request)
        arrays = parse_plan(plan, self.max_running_requests)
        speculative = plan.mode == "decode" and self.spec is not None
        step = self._write_slots(arrays, speculative)
        rows, positions, sampled = step.rows, step.positions, step.sampled
        if speculative:
            return self._speculative_decode(plan, arrays, step)
        host = arrays.host_batch(PLAN_MODES[plan.mode])
        batch = None
        if self.spec is not None:  # the draft prefill reads the batch too
            batch = host.to_device(self.device, self.runner.staging)
            out = self.runner.forward(batch)
        else:
            out = self.runner.forward_host(host)  # a CUDA graph for decode batches that fit
        want = bool(self.return_logprob[arrays.rows[arrays.sample]].any())
        token_ids, logprobs = self.sampling.sample(
            out.next_token_logits, rows, positions, want, rows_cpu=arrays.rows
        )
        if arrays.sample.any():
            self.sampling.observe(rows, token_ids, weights=sampled)
        if self.spec is not None:
            assert batch is not None
            # The draft's tail: the next prompt token for a non-final chunk, else the sample.
            next_ids = torch.from_numpy(arrays.next_input_ids).to(self.device)
            self.spec.draft_prefill(batch, out, torch.where(next_ids >= 0, next_ids, token_ids))
        fetched = self.results.fetch(token_ids, *([logprobs] if logprobs is not None else []))
        keep = arrays.sample  # host mask: requests that sampled this step
        return StepResult(
            plan_id=plan.plan_id,
            num_tokens=codec.pack_ids(keep.astype(np.int32)),
            token_ids=codec.pack_ids(fetched[0][keep]),
            logprobs=codec.pack_floats(fetched[1][keep]) if logprobs is not None else b"",
        )

    def _speculative_decode(
        self, plan: ForwardPlan, arrays: PlanArrays, step: StepInputs
    ) -> StepResult:
        assert self.spec is not None
        want = bool(self.return_logprob[arrays.rows].any())
        out = self.spec.decode(step.rows, arrays.rows, step.prefix_lens,
                               arrays.prefix_lens.tolist(), step.input_ids, want)  # fmt: skip
        self.sampling.observe(step.rows, out.tokens, lengths=out.accept_lens)
        # One copy to the host; the valid prefix of every row is sliced there.
        extra = [out.logprobs] if out.logprobs is not None else []
        accept_lens, tokens, *logprobs = self.results.fetch(out.accept_lens, out.tokens, *extra)
        keep = (np.arange(out.tokens.shape[1])[None, :] < accept_lens[:, None]).flatten()
        return StepResult(
            plan_id=plan.plan_id,
            num_tokens=codec.pack_ids(accept_lens),
            token_ids=codec.pack_ids(tokens[keep]),
            logprobs=codec.pack_floats(logprobs[0][keep]) if logprobs else b"",
            num_verify=codec.pack_ids([1] * len(plan.requests)),
        )

    def _start_request(self, request: PlanRequest) -> None:
        start = request.start
        assert start is not None
        self.sampling.start(
            request.req_pool_idx,
            start.sampling,
            codec.unpack_ids(start.prompt_ids),
            start.output_len,
            self.config.model.random_seed,
        )
        self.return_logprob[request.req_pool_idx] = start.return_logprob

    def _write_slots(self, arrays: PlanArrays, speculative: bool = False) -> StepInputs:
        """Record every assigned slot (headroom included) in every runner's req_to_token rows,
        uploading what the step reads per request in the same copy (the committed lengths and
        input ids only for a speculative decode: other steps upload their batch separately)."""
        bs = arrays.batch_size
        slot_rows = np.repeat(arrays.rows, arrays.slot_lens)
        slot_positions = np.repeat(arrays.prefix_lens, arrays.slot_lens)
        slot_positions += segment_offsets(arrays.slot_lens)
        new_positions = arrays.prefix_lens + arrays.extend_lens
        rows, positions, sampled, prefix_lens, input_ids, r, p, slots = self.staging.upload([
            arrays.rows, new_positions, arrays.sample.astype(np.int64),
            arrays.prefix_lens[: bs if speculative else 0],
            arrays.input_ids[: bs if speculative else 0], slot_rows, slot_positions, arrays.slots,
        ])  # fmt: skip
        for runner in self.runners:
            runner.req_to_token_pool.assign(r, p, slots)
        return StepInputs(rows, positions, sampled, prefix_lens, input_ids)


@dataclass(frozen=True)
class StepInputs:
    """A step's per-request arrays on the device, [bs] each.

    positions: the position of each request's new token (prefix_lens + extend_lens); sampled:
    1 where the request samples (int64); prefix_lens: the committed KV length before the step
    and input_ids: its one input token (both speculative decode only, else empty).
    """

    rows: torch.Tensor
    positions: torch.Tensor
    sampled: torch.Tensor
    prefix_lens: torch.Tensor
    input_ids: torch.Tensor
