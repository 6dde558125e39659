"""The socket-free scheduler core: requests in, one ForwardPlan per step out, results back in,
token deltas out. CPU only; tests drive it directly with a fake model.

Step protocol (one plan in flight): `next_plan()` -> the worker runs it -> `apply_result(plan,
result)`. Requests, aborts and stats can be handled at any time in between. Every delta
(new tokens, finishes, aborts) is queued and handed out by `take_deltas()`; `apply_result`
returns them too.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from aerie.codec import pack_floats, pack_ids, unpack_ids, unpack_ids_array
from aerie.config import AerieConfig
from aerie.messages import (
    DetokenizeStart,
    FinishReason,
    ForwardPlan,
    RequestDelta,
    SchedulerStats,
    StepResult,
    TokenDeltas,
    TokenizedRequest,
)
from scheduler_proc.kv_allocator import KVAllocator
from scheduler_proc.plan import build_decode_plan, build_extend_plan
from scheduler_proc.policy import NewTokenEstimate, SchedulePolicy, decode_alloc_len_for
from scheduler_proc.request import ReqState, Request
from scheduler_proc.stop import FinishChecker

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256
PROMPT_TAIL_LEN = 5  # prompt ids sent to the detokenizer as decoding context


class Scheduler:
    """Owns every unfinished request, the KV allocator and the step policy. Not thread-safe."""

    def __init__(
        self,
        config: AerieConfig,
        eos_token_ids: tuple[int, ...] | list[int],
        max_total_tokens: int,
        decode_tokens: Callable[[list[int]], str] | None = None,
        decode_alloc_len: int | None = None,
    ) -> None:
        """decode_tokens: ids -> text, used only for stop strings. decode_alloc_len: positions
        reserved per decode step (default: `decode_alloc_len_for(config)`)."""
        page_size = config.cache.page_size
        max_running = config.scheduler.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS
        self.allocator = KVAllocator(max_total_tokens // page_size, page_size, max_running)
        self.policy = SchedulePolicy(
            chunked_prefill_size=config.scheduler.chunked_prefill_size,
            decode_alloc_len=decode_alloc_len or decode_alloc_len_for(config),
            max_running_requests=max_running,
        )
        self.finish_checker = FinishChecker(
            eos_token_ids, decode_tokens, config.model.context_length
        )
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self._requests: dict[str, Request] = {}  # every unfinished request by rid
        self._deltas: list[RequestDelta] = []
        self._in_flight: ForwardPlan | None = None
        self._in_flight_rids: set[str] = set()
        self._next_plan_id = 0
        self._last_mode = ""
        self._num_decode_tokens = 0  # tokens from decode entries with verify counts
        self._num_verify = 0
        self._accepted_per_position: list[int] = []
        self._num_retractions = 0
        # Admission's estimate of the KV running requests will still take.
        self.new_tokens = NewTokenEstimate(config.scheduler.schedule_conservativeness)

    # ------------------------------------------------------------------ requests in

    def add_request(self, msg: TokenizedRequest) -> None:
        if msg.rid in self._requests:
            logger.warning("ignoring a request with duplicate rid %r", msg.rid)
            return
        req = Request(
            rid=msg.rid,
            prompt_ids=unpack_ids(msg.input_ids),
            sampling=msg.sampling,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
        )
        self._requests[req.rid] = req
        if not req.prompt_ids:
            self._finish(req, FinishReason("abort", message="the prompt is empty"))
        elif req.sampling.max_new_tokens <= 0:
            self._finish(req, FinishReason("length"))
        elif self.policy.never_fits(req, self.allocator):
            message = (
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens "
                f"({req.sampling.max_new_tokens}) does not fit in the KV cache "
                f"({self.allocator.num_total_tokens} tokens)"
            )
            self._finish(req, FinishReason("abort", message=message))
        else:
            self.waiting.append(req)

    def abort(self, rid: str) -> None:
        """Abort a request; one in the plan in flight finishes when its result arrives."""
        req = self._requests.get(rid)
        if req is None:
            return
        if req.state == ReqState.WAITING:
            self.waiting.remove(req)
        elif rid in self._in_flight_rids:
            req.abort_pending = True
            return
        self._finish(req, FinishReason("abort", message="aborted by the client"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ plans out

    def next_plan(self) -> ForwardPlan | None:
        """The next step's plan, or None when nothing can run. Allocates its KV."""
        if self._in_flight is not None:
            raise RuntimeError("a plan is already in flight")
        plan = self._schedule()
        if plan is not None:
            self._in_flight = plan
            self._in_flight_rids = {r.rid for r in plan.requests}
            self._last_mode = plan.mode
        return plan

    def _schedule(self) -> ForwardPlan | None:
        while True:
            has_prefill = bool(self.waiting) or any(r.is_prefilling for r in self.running)
            has_decode = any(not r.is_prefilling for r in self.running)
            if self.policy.choose_extend_first(has_prefill, has_decode, self._last_mode):
                plan = self._plan_extend()
                if plan is not None:
                    return plan
            if has_decode:
                return self._plan_decode()
            if len(self.running) <= 1:
                return None
            # Prefill is stuck on KV held by other mid-prefill requests: give the newest's back.
            self.new_tokens.on_retract(self.running)
            self._retract(self.running[-1])

    def _plan_extend(self) -> ForwardPlan | None:
        decision = self.policy.plan_extend(
            self.running, self.waiting, self.allocator, self.new_tokens
        )
        if not decision.chunks:
            return None
        for req in decision.admitted:
            assert self.waiting.popleft() is req
            row = self.allocator.alloc_row()
            assert row is not None
            req.req_pool_idx, req.state = row, ReqState.RUNNING
            self.running.append(req)
        chunks = []
        for req, chunk_len in decision.chunks:
            slots = self.allocator.grow(req.req_pool_idx, req.prefix_len + chunk_len)
            assert slots is not None, "policy admitted more than the free KV"
            chunks.append((req, chunk_len, slots))
        return build_extend_plan(self._take_plan_id(), chunks)

    def _plan_decode(self) -> ForwardPlan:
        decision = self.policy.plan_decode(self.running, self.allocator)
        self.new_tokens.on_decode_step()
        if decision.retracted:
            self.new_tokens.on_retract(self.running)
        for req in decision.retracted:
            self._retract(req)
        batch = []
        for req in decision.batch:
            end = req.prefix_len + self.policy.decode_alloc_len
            slots = self.allocator.grow(req.req_pool_idx, end)
            assert slots is not None, "policy kept more decoders than the free KV"
            batch.append((req, slots))
        return build_decode_plan(self._take_plan_id(), batch)

    def _retract(self, req: Request) -> None:
        """Free its row and KV and put it at the front of the queue; outputs are kept."""
        logger.info("retracting %s (%d tokens) to free KV", req.rid, req.seq_len)
        self._num_retractions += 1
        self.allocator.free(req.req_pool_idx)
        self.running.remove(req)
        req.reset_for_retract()
        self.waiting.appendleft(req)

    def _take_plan_id(self) -> int:
        self._next_plan_id += 1
        return self._next_plan_id

    # ------------------------------------------------------------------ results in

    def apply_result(self, plan: ForwardPlan, result: StepResult) -> TokenDeltas | None:
        """Advance every request of `plan` by its tokens in `result`; finish, release KV.

        Returns the deltas queued so far (`take_deltas`).
        """
        if plan is not self._in_flight or result.plan_id != plan.plan_id:
            raise RuntimeError(f"result {result.plan_id} does not match the plan in flight")
        num_tokens = unpack_ids_array(result.num_tokens)  # [num_requests]
        token_ids = unpack_ids_array(result.token_ids)  # [sum(num_tokens)]
        logprobs = np.frombuffer(result.logprobs, dtype="<f4") if result.logprobs else None
        num_verify = (
            unpack_ids_array(result.num_verify)
            if result.num_verify
            else np.zeros(len(plan.requests), dtype=np.int32)
        )
        ends = np.cumsum(num_tokens)
        for i, entry in enumerate(plan.requests):
            req = self._requests.get(entry.rid)
            if req is None:
                continue
            start, end = int(ends[i] - num_tokens[i]), int(ends[i])
            self._apply_entry(
                req,
                plan.mode,
                len(entry.input_ids) // 4,
                int(num_verify[i]),
                token_ids[start:end],
                None if logprobs is None else logprobs[start:end],
            )
        self._in_flight, self._in_flight_rids = None, set()
        return self.take_deltas()

    def _apply_entry(
        self,
        req: Request,
        mode: str,
        num_input: int,
        num_verify: int,
        new_ids: np.ndarray,
        new_logprobs: np.ndarray | None,
    ) -> None:
        if req.abort_pending:
            self._finish(req, FinishReason("abort", message="aborted by the client"))
            return
        req.spec_verify_ct += num_verify
        if mode == "extend":
            req.prefix_len += num_input
        else:
            # The input token and the accepted drafts now have KV; the newest token has none.
            req.prefix_len += len(new_ids)
            self._count_accepts(len(new_ids), num_verify)
        if len(new_ids) == 0:
            return
        num_keep, finish = self.finish_checker.check(req, new_ids)
        req.output_ids.extend(new_ids[:num_keep].tolist())
        if req.return_logprob:  # keep output_logprobs aligned with output_ids
            if new_logprobs is None:
                req.output_logprobs.extend([float("nan")] * num_keep)
            else:
                req.output_logprobs.extend(new_logprobs[:num_keep].tolist())
        if finish is not None:
            self._finish(req, finish)
            return
        if mode == "decode":
            self.allocator.shrink(req.req_pool_idx, req.prefix_len)
        self._emit(req)

    def _count_accepts(self, num_accepted: int, num_verify: int) -> None:
        if num_verify <= 0:
            return
        self._num_decode_tokens += num_accepted
        self._num_verify += num_verify
        if num_verify == 1:
            grow = num_accepted - len(self._accepted_per_position)
            self._accepted_per_position.extend([0] * max(grow, 0))
            for k in range(num_accepted):
                self._accepted_per_position[k] += 1

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished, release its row and KV, and queue its last delta."""
        req.finish, req.state = reason, ReqState.FINISHED
        if req.req_pool_idx:
            self.allocator.free(req.req_pool_idx)
            self.running.remove(req)
            req.req_pool_idx = 0
        del self._requests[req.rid]
        self._emit(req)

    # ------------------------------------------------------------------ deltas and stats out

    def _emit(self, req: Request) -> None:
        """Queue a delta with the outputs not sent yet (and the finish, if any)."""
        if req.num_sent == len(req.output_ids) and req.finish is None:
            return
        start = None
        if not req.detok_started:
            req.detok_started = True
            start = DetokenizeStart(
                skip_special_tokens=req.sampling.skip_special_tokens,
                stop=list(req.sampling.stop),
                stream=req.stream,
                prompt_tail_ids=pack_ids(req.prompt_ids[-PROMPT_TAIL_LEN:]),
            )
        self._deltas.append(
            RequestDelta(
                rid=req.rid,
                token_ids=pack_ids(req.output_ids[req.num_sent :]),
                logprobs=(
                    pack_floats(req.output_logprobs[req.num_sent :]) if req.return_logprob else b""
                ),
                finish=req.finish,
                prompt_tokens=len(req.prompt_ids),
                completion_tokens=len(req.output_ids),
                spec_verify_ct=req.spec_verify_ct,
                start=start,
            )
        )
        req.num_sent = len(req.output_ids)

    def take_deltas(self) -> TokenDeltas | None:
        """Every delta queued since the last call, or None."""
        if not self._deltas:
            return None
        deltas, self._deltas = self._deltas, []
        return TokenDeltas(deltas=deltas)

    def stats(self) -> SchedulerStats:
        avg = self._num_decode_tokens / self._num_verify if self._num_verify else 0.0
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_used_tokens=self.allocator.num_used_tokens,
            kv_total_tokens=self.allocator.num_total_tokens,
            avg_accept_length=avg,
            accepted_per_position=list(self._accepted_per_position),
            num_retractions=self._num_retractions,
        )
