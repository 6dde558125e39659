"""The socket-free scheduler core: requests in, one ForwardPlan per step out, results back in,
each step's outputs out. CPU only; tests drive it directly with a fake model.

Step protocol: `next_plan()` -> the worker runs it -> `apply_result(plan, result)`, with up to
`max_in_flight` plans sent and not yet applied (2 with the overlap schedule: the worker runs
step N+1 while the scheduler applies step N and plans N+2; 1 with --disable-overlap-schedule).
Results are applied in plan order. Requests, aborts and stats can be handled at any time in
between. Every output (new tokens, finishes, aborts) is queued and handed out by
`take_outputs()`, one columnar `StepOutputs` per frontend; `apply_result` returns them too.

With plans in flight the scheduler plans without knowing their results:
- a decode plan carries no tokens (the worker keeps each row's last token and committed
  length); KV is reserved for the worst case of every decode step in flight
  (`SchedulePolicy.decode_end`) and shrunk, once a result is known, only down to what the
  later plans in flight may still write;
- a request that finishes (or is aborted) while a later plan still holds it is reported at
  once, but keeps its row and KV until that plan's result is applied; the tokens that plan
  made for it are dropped, so outputs do not depend on the overlap;
- requests the plans in flight finish for sure are left out of the next decode step;
- retraction (which frees KV other plans may be writing) only happens with nothing in
  flight: a decode step that would need one, or whose headroom does not fit because KV is
  still held by requests the plans in flight finish, waits for the results instead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

from aerie.codec import pack_floats, pack_ids, unpack_floats, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import (
    FinishReason,
    ForwardPlan,
    SchedulerStats,
    StepOutputs,
    StepResult,
    TokenizedRequest,
)
from aerie.outputs import OutputsWriter
from aerie.step_costs import StepCosts
from scheduler_proc.adaptive import AdaptiveSpeculation
from scheduler_proc.kv_allocator import KVAllocator
from scheduler_proc.plan import build_decode_plan, build_extend_plan
from scheduler_proc.policy import NewTokenEstimate, SchedulePolicy, decode_alloc_len_for
from scheduler_proc.request import ReqState, Request
from scheduler_proc.stop import FinishChecker

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 256


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
        self.allocator = KVAllocator(
            max_total_tokens // page_size,
            page_size,
            max_running,
            prefix_cache=not config.cache.disable_radix_cache,
            draft_lookahead=config.speculative.draft_lookahead,
        )
        self.max_in_flight = 1 if config.scheduler.disable_overlap_schedule else 2
        self.policy = SchedulePolicy(
            chunked_prefill_size=config.scheduler.chunked_prefill_size,
            decode_alloc_len=decode_alloc_len or decode_alloc_len_for(config),
            max_running_requests=max_running,
            max_in_flight=self.max_in_flight,
        )
        self.context_length = config.model.context_length
        self.finish_checker = FinishChecker(eos_token_ids, decode_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self._requests: dict[str, Request] = {}  # every unfinished request by rid
        self._outputs = OutputsWriter()
        # Plans sent and not applied, oldest first: (plan, its requests, which of them sample).
        self._in_flight: deque[tuple[ForwardPlan, list[Request], list[bool]]] = deque()
        self._next_plan_id = 0
        self._last_mode = ""
        self._num_decode_tokens = 0  # tokens from decode entries with verify counts
        self._num_verify = 0
        self._accepted_per_position: list[int] = []
        self._num_plain_steps = 0  # decode steps of a speculative server run plainly
        self._num_decode_steps = 0  # decode steps applied (plain steps and iterations)
        self._stale_drafts: dict[int, set[str]] = {}  # plan id -> rids drafting from old state
        self._num_retractions = 0
        self._num_requests = 0  # requests received since start
        self._num_prefill_tokens = 0  # fill tokens of admitted requests, cached or not
        self._num_cached_tokens = 0  # of them, reused from the prefix cache
        # Admission's estimate of the KV running requests will still take.
        self.new_tokens = NewTokenEstimate(config.scheduler.schedule_conservativeness)
        spec = config.speculative
        self.speculative = spec.enabled
        # Speculate or decode plainly, step by step; without step costs (none were measured:
        # CPU), or with --speculative-adaptive off, every decode step speculates.
        self.adaptive: AdaptiveSpeculation | None = None
        if spec.adaptive and spec.speculative_step_costs:
            self.adaptive = AdaptiveSpeculation(
                StepCosts.from_json(spec.speculative_step_costs),
                max_accept=(spec.speculative_num_steps or 1) + 1,
            )

    # ------------------------------------------------------------------ requests in

    def add_request(self, msg: TokenizedRequest) -> None:
        if msg.rid in self._requests:
            logger.warning("ignoring a request with duplicate rid %r", msg.rid)
            return
        req = Request(
            rid=msg.rid,
            prompt_ids=unpack_ids(msg.input_ids),
            sampling=msg.sampling,
            return_logprob=msg.return_logprob,
            frontend=msg.frontend,
            context_length=self.context_length,
        )
        self._requests[req.rid] = req
        self._num_requests += 1
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
        """Abort a request at once (a plan in flight that holds it keeps its row until done)."""
        req = self._requests.get(rid)
        if req is None:
            return
        if req.state == ReqState.WAITING:
            self.waiting.remove(req)
        self._finish(req, FinishReason("abort", message="aborted by the client"))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def oldest_in_flight(self) -> ForwardPlan | None:
        """The plan the next result answers (results come back in plan order)."""
        return self._in_flight[0][0] if self._in_flight else None

    def can_plan(self) -> bool:
        """Whether another plan may be sent now (fewer than max_in_flight in flight)."""
        return len(self._in_flight) < self.max_in_flight

    # ------------------------------------------------------------------ plans out

    def next_plan(self) -> ForwardPlan | None:
        """The next step's plan, or None when nothing can run now. Allocates its KV."""
        if not self.can_plan():
            raise RuntimeError(f"{len(self._in_flight)} plans are already in flight")
        scheduled = self._schedule()
        if scheduled is None:
            return None
        plan, requests, samples = scheduled
        self._in_flight.append((plan, requests, samples))
        self._last_mode = plan.mode
        decode = plan.mode == "decode"
        for req, sample in zip(requests, samples, strict=True):
            req.in_flight += 1
            req.samples_in_flight += sample
            req.decodes_in_flight += decode
        return plan

    def _schedule(self) -> tuple[ForwardPlan, list[Request], list[bool]] | None:
        while True:
            has_prefill = bool(self.waiting) or any(r.is_prefilling for r in self.running)
            has_decode = any(self.policy.is_decoding(r) for r in self.running)
            if self.policy.choose_extend_first(has_prefill, has_decode, self._last_mode):
                plan = self._plan_extend()
                if plan is not None:
                    return plan
            if has_decode:
                return self._plan_decode()
            if len(self.running) <= 1 or self._in_flight:
                return None  # (in flight: their results may free KV or finish requests)
            # Prefill is stuck on KV held by other mid-prefill requests: give the newest's back.
            self.new_tokens.on_retract(self.running)
            self._retract(self.running[-1])

    def _plan_extend(self) -> tuple[ForwardPlan, list[Request], list[bool]] | None:
        decision = self.policy.plan_extend(
            self.running, self.waiting, self.allocator, self.new_tokens
        )
        if not decision.chunks:
            return None
        for req, cached in zip(decision.admitted, decision.cached_lens, strict=True):
            assert self.waiting.popleft() is req
            row = self.allocator.alloc_row(req.fill_ids[:cached])
            assert row is not None
            req.row, req.state, req.committed_len = row, ReqState.RUNNING, cached
            if req.cached_tokens is None:  # a retracted request reports its first admission
                req.cached_tokens = cached
            self._num_prefill_tokens += len(req.fill_ids)
            self._num_cached_tokens += cached
            self.running.append(req)
        chunks = []
        for req, chunk_len in decision.chunks:
            end = req.committed_len + chunk_len
            slots = self.allocator.grow(req.row, end)
            assert slots is not None, "policy admitted more than the free KV"
            if req.needs_start and req.committed_len:  # a new row: its cached slots too
                slots = self.allocator.slots(req.row, 0, end)
            chunks.append((req, chunk_len, slots))
        plan = build_extend_plan(self._take_plan_id(), chunks)
        samples = []
        for req, chunk_len, _ in chunks:  # chunks are committed when planned
            req.committed_len += chunk_len
            samples.append(req.committed_len == len(req.fill_ids))  # its last chunk samples
        return plan, [req for req, _, _ in chunks], samples

    def _plan_decode(self) -> tuple[ForwardPlan, list[Request], list[bool]] | None:
        decision = self.policy.plan_decode(self.running, self.allocator)
        if (decision.retracted or not decision.fits) and self._in_flight:
            # Retract only with nothing in flight, and let the plans in flight give back
            # the KV of the requests they finish: wait for their results.
            return None
        self.new_tokens.on_decode_step()
        if decision.retracted:
            self.new_tokens.on_retract(self.running)
        for req in decision.retracted:
            self._retract(req)
        batch = decision.batch
        grown = self.allocator.grow_rows([req.row for req in batch], decision.ends)
        assert grown is not None, "policy kept more decoders than the free KV"
        speculate = self.speculative and self._speculate(batch)
        plan = build_decode_plan(self._take_plan_id(), batch, *grown, speculate=speculate)
        if self.adaptive is not None:
            # An iteration right after a plain step drafts from the state the draft had
            # before it (its extend then catches up): its acceptance says nothing of the draft.
            stale = {req.rid for req in batch if not req.draft_fresh} if speculate else set()
            if stale:
                self._stale_drafts[plan.plan_id] = stale
            for req in batch:
                req.draft_fresh = speculate
        return plan, batch, [True] * len(batch)

    def _speculate(self, batch: list[Request]) -> bool:
        """Adaptive speculation's choice for this decode batch (True without it)."""
        if self.adaptive is None:
            return True
        before = self.adaptive.last
        choice = self.adaptive.choose(
            [req.rid for req in batch], [req.accept_kind for req in batch]
        )
        if before is None or before.speculate != choice.speculate or choice.probe:
            logger.debug(
                "adaptive speculation: %s for a batch of %d (expected %s tokens per "
                "iteration, give or take %.2f; break-even %.2f)",
                "a probing iteration"
                if choice.probe
                else "speculate"
                if choice.speculate
                else "plain decoding",
                len(batch),
                "unknown" if choice.expected is None else f"{choice.expected:.2f}",
                choice.error,
                choice.break_even,
            )
        return choice.speculate

    def _retract(self, req: Request) -> None:
        """Free its row and KV and put it at the front of the queue; outputs are kept."""
        logger.info("retracting %s (%d tokens) to free KV", req.rid, req.num_tokens)
        self._num_retractions += 1
        self.allocator.free(req.row, self._kv_token_ids(req))  # cached: re-admission reuses it
        self.running.remove(req)
        req.reset_for_retract()
        self.waiting.appendleft(req)

    def _take_plan_id(self) -> int:
        self._next_plan_id += 1
        return self._next_plan_id

    def plan_rids(self, plan: ForwardPlan) -> list[str]:
        """The rids of a plan in flight, in plan order (for logs and tests)."""
        for sent, requests, _ in self._in_flight:
            if sent is plan:
                return [req.rid for req in requests]
        raise KeyError(f"plan {plan.plan_id} is not in flight")

    # ------------------------------------------------------------------ results in

    def apply_result(self, plan: ForwardPlan, result: StepResult) -> list[StepOutputs]:
        """Advance every request of `plan` (the oldest in flight) by its tokens in `result`;
        finish, release KV. Returns the outputs queued so far (`take_outputs`)."""
        if not self._in_flight or plan is not self._in_flight[0][0]:
            raise RuntimeError(f"plan {plan.plan_id} is not the oldest plan in flight")
        if result.plan_id != plan.plan_id:
            raise RuntimeError(f"result {result.plan_id} does not answer plan {plan.plan_id}")
        _, requests, samples = self._in_flight.popleft()
        # Lists, converted once per step: indexing numpy arrays per request costs more.
        counts = unpack_ids(result.num_tokens)  # [num_requests]
        ids = unpack_ids(result.token_ids)  # [sum(num_tokens)]
        logprobs = unpack_floats(result.logprobs) if result.logprobs else None
        verify = unpack_ids(result.num_verify) if result.num_verify else [0] * len(requests)
        packed = result.token_ids  # ids as int32 bytes: a delta's token_ids are slices of it
        decode = plan.mode == "decode"
        plain_speculative = decode and self.speculative and not plan.speculate
        self._num_decode_steps += decode
        stale = self._stale_drafts.pop(plan.plan_id, ())
        if plain_speculative:  # one target forward each: counted like a verify of no drafts
            verify = [1] * len(requests)
            self._num_plain_steps += 1
        end = 0
        for req, sample, n, num_verify in zip(requests, samples, counts, verify, strict=True):
            start, end = end, end + n
            req.in_flight -= 1
            req.samples_in_flight -= sample
            req.decodes_in_flight -= decode
            if req.state is ReqState.FINISHED:  # finished while this plan was in flight
                if req.in_flight == 0:
                    self._release(req)
                continue
            if not plain_speculative:
                self._observe_accept(req, decode, num_verify, n, req.rid not in stale)
            self._apply_entry(req, decode, num_verify, ids, logprobs, packed, start, end)
        return self.take_outputs()

    def _observe_accept(
        self, req: Request, decode: bool, num_verify: int, n: int, fresh: bool
    ) -> None:
        """Acceptance stats of an entry from a speculative iteration (num_verify > 0); fresh:
        the draft drafted from its up-to-date state (adaptive speculation learns from it)."""
        if not decode or num_verify == 0:
            return
        self._num_decode_tokens += n
        self._num_verify += num_verify
        if num_verify == 1:
            grow = n - len(self._accepted_per_position)
            self._accepted_per_position.extend([0] * max(grow, 0))
            for k in range(n):
                self._accepted_per_position[k] += 1
            if self.adaptive is not None and fresh:
                self.adaptive.observe(req.rid, n, req.accept_kind)

    def _apply_entry(
        self,
        req: Request,
        decode: bool,
        num_verify: int,
        ids: list[int],
        logprobs: list[float] | None,
        packed: bytes,
        start: int,
        end: int,
    ) -> None:
        """Advance req by its tokens ids[start:end] of the step (logprobs alike; packed: the
        ids as int32 bytes)."""
        req.spec_verify_ct += num_verify
        if decode:
            # The input token and the accepted drafts now have KV; the newest token has none.
            req.committed_len += end - start
        if start == end:
            return
        new_ids = ids[start:end]
        num_keep, finish = self.finish_checker.check(req, new_ids)
        output_ids = req.output_ids
        output_ids += new_ids[:num_keep]
        if req.return_logprob:  # keep output_logprobs aligned with output_ids
            if logprobs is None:
                req.output_logprobs.extend([float("nan")] * num_keep)
            else:
                req.output_logprobs.extend(logprobs[start : start + num_keep])
        if finish is not None:
            self._finish(req, finish)
            return
        if decode:  # keep what the decode steps still in flight may write
            keep = req.committed_len + self.policy.decode_alloc_len * req.decodes_in_flight
            self.allocator.shrink(req.row, keep)
        # The delta carries the outputs not sent yet. When they are the kept new ids (always in
        # practice: every step sends what it adds), their bytes are a slice of the result's.
        unsent_is_new = req.num_sent + num_keep == len(output_ids)
        self._emit(req, packed[4 * start : 4 * (start + num_keep)] if unsent_is_new else None)

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark finished and queue its last delta; release its row and KV now, or when the
        last plan in flight that holds it is applied (its whole pages are cached now: a
        client's next turn may arrive before that plan is applied)."""
        if req.state == ReqState.RUNNING:
            self.running.remove(req)
        req.finish, req.state = reason, ReqState.FINISHED
        if self.adaptive is not None:
            self.adaptive.forget(req.rid)
        if req.in_flight == 0:
            self._release(req)
        elif req.row:  # reusable now, not only once the plans that hold it are applied
            self.allocator.cache_row(req.row, self._kv_token_ids(req))
        del self._requests[req.rid]
        self._emit(req)

    def _release(self, req: Request) -> None:
        if req.row:
            self.allocator.free(req.row, self._kv_token_ids(req))
            req.row = 0

    @staticmethod
    def _kv_token_ids(req: Request) -> list[int]:
        """The tokens at the positions with KV: prompt and outputs up to committed_len (a
        finishing step's KV may run past the outputs it kept)."""
        tokens = req.prompt_ids + req.output_ids
        return tokens[: req.committed_len]

    # ------------------------------------------------------------------ deltas and stats out

    def _emit(self, req: Request, packed_unsent: bytes | None = None) -> None:
        """Queue the outputs not sent yet (and the finish, if any) for req's frontend.

        packed_unsent: those outputs as int32 bytes, when the caller has them (else packed
        here; an output per request per step makes the packing show)."""
        if req.num_sent == len(req.output_ids) and req.finish is None:
            return
        if packed_unsent is None:
            packed_unsent = pack_ids(req.output_ids[req.num_sent :])
        logprobs = pack_floats(req.output_logprobs[req.num_sent :]) if req.return_logprob else None
        self._outputs.add(
            req.frontend,
            req.rid,
            packed_unsent,
            req.spec_verify_ct,
            req.cached_tokens or 0,
            logprobs,
            req.finish,
        )
        req.num_sent = len(req.output_ids)

    def take_outputs(self) -> list[StepOutputs]:
        """Every output queued since the last call: one message per frontend (none: [])."""
        return self._outputs.take() if self._outputs else []

    def describe(
        self, check_kv: bool = False
    ) -> tuple[dict[str, int | bool], list[dict[str, int | str | bool]]]:
        """(summary, one entry per request held): where each request is and why it may not
        move, for a debug view. Reads only; counts and lengths, no token ids. check_kv (after
        a flush): an idle scheduler also says whether its KV is whole (`kv_whole`)."""
        summary = {
            "can_plan": self.can_plan(),
            "plans_in_flight": len(self._in_flight),
            "free_pages": self.allocator.num_free_pages,
            "prefix_cache_tokens": self._cache_stats().get("prefix_cache_tokens", 0),
            "free_rows": self.allocator.num_free_rows,
            "num_retractions": self._num_retractions,
        }
        held = {id(req): req for _, requests, _ in self._in_flight for req in requests}
        held.update((id(req), req) for req in self._requests.values())
        if check_kv and not held:  # idle: every page and row free or cached, each once
            summary["kv_whole"] = self.allocator.is_whole()
        position = {id(req): i for i, req in enumerate(self.waiting)}
        entries = []
        for req in held.values():
            entry: dict[str, int | str | bool] = {
                "rid": req.rid,
                "state": req.state.value,
                "row": req.row,
                "committed_len": req.committed_len,
                "fill_len": len(req.fill_ids),
                "output_len": len(req.output_ids),
                "max_new_tokens": req.sampling.max_new_tokens,
                "num_sent": req.num_sent,
                "plans_in_flight": req.in_flight,
            }
            if id(req) in position:
                entry["queue_position"] = position[id(req)]
            entries.append(entry)
        return summary, entries

    def flush_cache(self) -> int:
        """Drop every cached prefix no running request uses; -> the tokens dropped."""
        return self.allocator.flush_cache() * self.allocator.page_size

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
            num_requests=self._num_requests,
            num_plain_steps=self._num_plain_steps,
            num_decode_steps=self._num_decode_steps,
            prefill_tokens=self._num_prefill_tokens,
            cached_prefill_tokens=self._num_cached_tokens,
            **self._cache_stats(),
            **self._adaptive_stats(),
        )

    def _cache_stats(self) -> dict[str, int]:
        cache = self.allocator.cache
        if cache is None:
            return {}
        page_size = self.allocator.page_size
        return {
            "prefix_cache_tokens": cache.num_pages * page_size,
            "prefix_cache_evictable_tokens": cache.num_evictable_pages * page_size,
        }

    def _adaptive_stats(self) -> dict[str, float | int]:
        """Adaptive speculation's last choice and why, for /server_info and /metrics."""
        last = self.adaptive.last if self.adaptive is not None else None
        if last is None:
            return {}
        return {
            "speculating": int(last.speculate),
            "expected_accept_length": last.expected or 0.0,
            "expected_accept_error": last.error,
            "break_even_accept_length": last.break_even,
        }
