"""`GPUWorker`: the socket-free core of the GPU worker process.

It owns the target `ModelRunner` and the per-row `SamplingState`. `execute(plan)` applies the
scheduler's slot assignments to the runner's req_to_token pool, runs one forward, samples the
requests that asked for a token and returns a `StepResult`.
"""

from __future__ import annotations

import torch

from aerie import codec
from aerie.config import AerieConfig
from aerie.messages import ForwardPlan, PlanRequest, StepResult
from gpu_worker.forward_batch import ForwardMode, build_forward_batch
from gpu_worker.model_runner import ModelRunner
from gpu_worker.sampling import SamplingState

DEFAULT_MAX_RUNNING_REQUESTS = 64
PLAN_MODES = {"extend": ForwardMode.EXTEND, "decode": ForwardMode.DECODE}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[dtype]


class GPUWorker:
    def __init__(self, config: AerieConfig) -> None:
        """config: resolved (model_path a local directory; device and dtype concrete, though
        "auto" is tolerated for tests)."""
        if not config.model.model_path:
            raise ValueError("config.model.model_path is not resolved")
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.max_running_requests = (
            config.scheduler.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        )
        self.runner = ModelRunner(
            config.model.model_path,
            device=self.device,
            dtype=self.dtype,
            load_format=config.model.load_format,
            seed=config.model.random_seed,
            page_size=config.cache.page_size,
            max_total_tokens=config.cache.max_total_tokens,
            max_running_requests=self.max_running_requests,
            context_length=config.model.context_length,
            attention_backend=config.runner.attention_backend,
            mem_fraction_static=config.cache.mem_fraction_static,
        )
        self.sampling = SamplingState(
            self.max_running_requests, self.runner.vocab_size, self.device
        )
        # Per request row: whether its request asked for logprobs (host side).
        self.return_logprob = [False] * (self.max_running_requests + 1)

    def info(self) -> dict[str, int | float | str]:
        """What the launcher and scheduler need to know (sent in ProcessReady)."""
        return {
            "max_total_tokens": self.runner.max_total_tokens,
            "max_running_requests": self.max_running_requests,
            "vocab_size": self.runner.vocab_size,
            "context_length": self.runner.context_length,
            "page_size": self.runner.page_size,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def execute(self, plan: ForwardPlan) -> StepResult:
        """Run one scheduler step; returns the sampled tokens in plan order."""
        if plan.mode not in PLAN_MODES:
            raise ValueError(f"unknown plan mode {plan.mode!r}")
        requests = plan.requests
        if not requests:
            return StepResult(plan_id=plan.plan_id, num_tokens=b"", token_ids=b"")
        for request in requests:
            if request.start is not None:
                self._start_request(request)
        input_ids = [codec.unpack_ids(r.input_ids) for r in requests]
        out_slots = [codec.unpack_ids(r.out_slots) for r in requests]
        self._check_plan(plan, input_ids, out_slots)
        self._write_slots(requests, out_slots)
        batch = build_forward_batch(
            PLAN_MODES[plan.mode],
            input_ids,
            [r.prefix_len for r in requests],
            [slots[: len(ids)] for ids, slots in zip(input_ids, out_slots, strict=True)],
            [r.req_pool_idx for r in requests],
            self.device,
        )
        logits = self.runner.forward(batch).next_token_logits  # [bs, V]: one row per request
        return self._sample(plan, logits, batch.seq_lens_cpu)

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

    def _check_plan(
        self, plan: ForwardPlan, input_ids: list[list[int]], out_slots: list[list[int]]
    ) -> None:
        for request, ids, slots in zip(plan.requests, input_ids, out_slots, strict=True):
            if not ids or len(slots) < len(ids):
                raise ValueError(f"{request.rid}: {len(ids)} input ids, {len(slots)} out slots")
            if plan.mode == "decode" and len(ids) != 1:
                raise ValueError(f"{request.rid}: a decode step runs one token, got {len(ids)}")
            if not 0 < request.req_pool_idx <= self.max_running_requests:
                raise ValueError(f"{request.rid}: req_pool_idx {request.req_pool_idx} is invalid")

    def _write_slots(self, requests: list[PlanRequest], out_slots: list[list[int]]) -> None:
        """Record every assigned slot (headroom included) in the runner's req_to_token rows."""
        device = self.device
        self.runner.req_to_token_pool.write(
            torch.tensor([r.req_pool_idx for r in requests]).to(device),
            torch.tensor([r.prefix_len for r in requests]).to(device),
            torch.tensor([s for slots in out_slots for s in slots], dtype=torch.int32).to(device),
            torch.tensor([len(slots) for slots in out_slots]).to(device),
        )

    def _sample(self, plan: ForwardPlan, logits: torch.Tensor, seq_lens: list[int]) -> StepResult:
        """Sample the rows whose request asked for a token; the others get 0 tokens."""
        sampled = [i for i, r in enumerate(plan.requests) if r.sample]
        num_tokens = [int(r.sample) for r in plan.requests]
        if not sampled:
            return StepResult(plan.plan_id, codec.pack_ids(num_tokens), b"")
        rows = torch.tensor([plan.requests[i].req_pool_idx for i in sampled])  # [n] on host
        positions = torch.tensor([seq_lens[i] for i in sampled])  # position of the new token
        index = torch.tensor(sampled, device=logits.device)
        token_ids, logprobs = self.sampling.sample(logits[index], rows, positions)
        self.sampling.observe(rows, token_ids)
        want_logprobs = any(self.return_logprob[int(row)] for row in rows)
        return StepResult(
            plan_id=plan.plan_id,
            num_tokens=codec.pack_ids(num_tokens),
            token_ids=codec.pack_ids(token_ids.cpu()),
            logprobs=codec.pack_floats(logprobs.cpu()) if want_logprobs else b"",
        )
