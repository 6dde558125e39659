"""Scheduling decisions: what runs next step. Pure: reads requests and the allocator, mutates
nothing (the `Scheduler` applies the decision).

- Prefill is preferred (new requests get their first token soon), but when both prefill and
  decode work are pending the modes alternate, so decode never starves.
- An extend step continues mid-prefill requests first, then admits waiting requests FCFS
  while a row, the token budget (`chunked_prefill_size`) and free KV allow; a long prompt is
  split over steps. Admission keeps back the pages running decoders need for their next step
  and, for every running request, an estimate of the KV its remaining output will take:
  `new_token_ratio` times its remaining max_new_tokens (`NewTokenEstimate`, after SGLang).
  Admitting on free KV alone lets a burst of requests fill the cache, and once their outputs
  grow they are retracted and recomputed over and over.
- A decode step runs every decoding request with `decode_alloc_len` positions of headroom
  past where it will stand when the plans in flight are done: each decode step in flight may
  advance it by up to `decode_alloc_len`, so the step reserves up to
  `committed_len + decode_alloc_len * (1 + decodes_in_flight)` (`decode_end`). When KV runs short
  the newest running requests are retracted until it fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from aerie.config import AerieConfig
from scheduler_proc.kv_allocator import KVAllocator, ceil_div
from scheduler_proc.request import Request


def decode_alloc_len_for(config: AerieConfig) -> int:
    """Positions reserved per request per decode step: 1, or the speculative headroom."""
    return config.speculative.decode_alloc_len


class NewTokenEstimate:
    """The share of their remaining max_new_tokens that running requests are expected to
    still generate (most stop early at EOS). Starts at INIT, decays by DECAY per decode step
    towards MIN while nothing is retracted, and after a retraction jumps to what the retracted
    batch actually needed (plus RETRACT_MARGIN_STEPS more tokens each), so admission backs off
    exactly when the estimate proved too optimistic."""

    INIT = 0.7
    MIN = 0.1
    DECAY = (INIT - MIN) / 600
    RETRACT_MARGIN_STEPS = 20

    def __init__(self, conservativeness: float = 1.0) -> None:
        """conservativeness scales INIT and MIN (0: admit on free KV alone until a retraction
        shows that more must be kept back)."""
        self.min = self.MIN * conservativeness
        self.ratio = self.INIT * conservativeness
        self.known_share = min(1.0, conservativeness)  # of an output that cannot end early

    def on_decode_step(self) -> None:
        self.ratio = max(self.min, self.ratio - self.DECAY)

    def on_retract(self, running: Sequence[Request]) -> None:
        """running: the batch the retraction happened in (before it)."""
        decoded = sum(len(r.output_ids) for r in running)
        max_new = sum(max(r.sampling.max_new_tokens, 1) for r in running)
        needed = (decoded + self.RETRACT_MARGIN_STEPS * len(running)) / max_new
        self.ratio = min(1.0, max(self.ratio, needed))

    def future_tokens(self, req: Request) -> int:
        """KV positions req is expected to still need for its outputs: all of its remaining
        max_new_tokens when nothing can end it early (ignore_eos, no stop tokens or strings),
        else the estimated share (both scaled down by a conservativeness below 1)."""
        sampling = req.sampling
        known = sampling.ignore_eos and not (sampling.stop or sampling.stop_token_ids)
        share = self.known_share if known else self.ratio
        return math.ceil(share * req.num_remaining_new_tokens)


@dataclass
class ExtendDecision:
    """Prefill chunks for this step: (request, chunk_len); `admitted` are new to the batch."""

    chunks: list[tuple[Request, int]] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    cached_lens: list[int] = field(default_factory=list)  # each admitted one's reused prefix


@dataclass
class DecodeDecision:
    batch: list[Request] = field(default_factory=list)
    retracted: list[Request] = field(default_factory=list)  # newest first
    fits: bool = True  # the batch's headroom fits in the free KV (after the retractions)
    ends: list[int] = field(default_factory=list)  # `decode_end` of each batch request


class SchedulePolicy:
    """Step decisions under a token budget, a row limit and free KV pages."""

    def __init__(
        self,
        chunked_prefill_size: int,
        decode_alloc_len: int,
        max_running_requests: int,
        max_in_flight: int = 1,
    ) -> None:
        """max_in_flight: plans the scheduler keeps in flight (2 with overlap). The context
        length is each request's own (`Request.max_output_len`)."""
        self.chunked_prefill_size = chunked_prefill_size
        self.decode_alloc_len = decode_alloc_len
        self.max_running_requests = max_running_requests
        self.max_in_flight = max_in_flight

    def max_positions(self, req: Request) -> int:
        """The most positions the request can ever hold: its last decode plus headroom.

        A request decodes while out + k < max_new (out: outputs known, k: steps in flight that
        sample for it, at most max_in_flight - 1) and reserves `decode_end` =
        prompt + out - 1 + alloc * (1 + k), so at most prompt + max_new - 2 + alloc +
        k * (alloc - 1): plain decoding (alloc 1) never needs more than without overlap."""
        max_new = max(req.sampling.max_new_tokens, 1)
        alloc, k = self.decode_alloc_len, self.max_in_flight - 1
        return len(req.prompt_ids) + max_new - 1 + alloc + k * (alloc - 1)

    def finishes_in_flight(self, req: Request) -> bool:
        """Whether the plans in flight finish it for sure (each one that samples for it adds
        at least one token) by max_new_tokens or the context length: it must not decode again,
        its extra tokens would be dropped."""
        return len(req.output_ids) + req.samples_in_flight >= req.max_output_len

    def is_decoding(self, req: Request) -> bool:
        """Prefilled, and not certain to finish before its next decode step could run."""
        return not req.is_prefilling and not self.finishes_in_flight(req)

    def decode_end(self, req: Request) -> int:
        """Positions a decoding request must have slots for before its next decode step."""
        return req.committed_len + self.decode_alloc_len * (1 + req.decodes_in_flight)

    def never_fits(self, req: Request, allocator: KVAllocator) -> bool:
        return ceil_div(self.max_positions(req), allocator.page_size) > allocator.num_pages

    def choose_extend_first(self, has_prefill: bool, has_decode: bool, last_mode: str) -> bool:
        """Prefer prefill, but after an extend step run decode if anyone is decoding."""
        return has_prefill and (not has_decode or last_mode != "extend")

    def decode_pages_needed(self, decoding: Sequence[Request], allocator: KVAllocator) -> int:
        rows = [r.row for r in decoding]
        return allocator.pages_needed_rows(rows, list(map(self.decode_end, decoding)))

    def plan_extend(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        allocator: KVAllocator,
        estimate: NewTokenEstimate | None = None,
    ) -> ExtendDecision:
        """Chunks for mid-prefill running requests, then FCFS admissions from `waiting`
        (keeping back `estimate`'s expected growth of every running request)."""
        decision = ExtendDecision()
        budget = self.chunked_prefill_size
        decoding = [r for r in running if self.is_decoding(r)]
        free_pages = allocator.num_free_pages - self.decode_pages_needed(decoding, allocator)
        future = sum(estimate.future_tokens(r) for r in running) if estimate else 0
        for req in running:
            if not req.is_prefilling or budget == 0:
                continue
            wanted = min(req.num_remaining_fill, budget)
            chunk_len = self._fit_chunk(req, wanted, free_pages, allocator)
            if chunk_len == 0:
                continue
            free_pages -= allocator.pages_needed(req.row, req.committed_len + chunk_len)
            decision.chunks.append((req, chunk_len))
            budget -= chunk_len
        num_rows = min(allocator.num_free_rows, self.max_running_requests - len(running))
        reused: dict[int, int] = {}  # cached pages this decision's admissions lock already
        for req in waiting:
            if budget == 0 or len(decision.admitted) >= num_rows:
                break
            # A cached prefix takes no new pages, but the evictable ones it reuses stop being free.
            cached, reused_pages = allocator.cached_prefix(req.fill_ids, reused)
            chunk_len = min(len(req.fill_ids) - cached, budget)
            end = cached + chunk_len
            if end == len(req.fill_ids):  # it decodes next step: keep its headroom too
                end += self.decode_alloc_len
            pages = ceil_div(end, allocator.page_size) - cached // allocator.page_size
            pages += reused_pages
            if pages > free_pages:
                break  # FCFS: nobody overtakes the head of the queue
            own_future = estimate.future_tokens(req) if estimate else 0
            alone = not running and not decision.admitted  # always admit into an empty batch
            if not alone and pages + ceil_div(future + own_future, allocator.page_size) > (
                free_pages
            ):
                break
            free_pages -= pages
            future += own_future
            decision.chunks.append((req, chunk_len))
            decision.admitted.append(req)
            decision.cached_lens.append(cached)
            budget -= chunk_len
        return decision

    def _fit_chunk(
        self, req: Request, chunk_len: int, free_pages: int, allocator: KVAllocator
    ) -> int:
        """The longest chunk <= chunk_len whose pages fit in free_pages."""
        row, page_size = req.row, allocator.page_size
        if allocator.pages_needed(row, req.committed_len + chunk_len) <= free_pages:
            return chunk_len
        capacity = (allocator.num_held_pages(row) + max(free_pages, 0)) * page_size
        return max(0, min(chunk_len, capacity - req.committed_len))

    def plan_decode(self, running: Sequence[Request], allocator: KVAllocator) -> DecodeDecision:
        """Every decoding request, after retracting the newest running ones until KV fits.

        `running` is in admission order. At least one decoding request always stays (a
        request that fits alone was checked at admission by `never_fits`). With plans in
        flight the KV may still not fit (`fits` False): pages held by requests that finish
        in flight, or by finished ones a plan in flight still holds, come back only with
        those plans' results.
        """
        decoding_list = [r for r in running if self.is_decoding(r)]
        ends = list(map(self.decode_end, decoding_list))
        need = allocator.pages_needed_rows([r.row for r in decoding_list], ends)
        free_pages = allocator.num_free_pages
        if need <= free_pages:  # the usual step: nothing to retract
            return DecodeDecision(batch=decoding_list, ends=ends)
        decoding = set(decoding_list)
        kept = list(running)
        retracted: list[Request] = []
        released: dict[int, int] = {}  # cached nodes the retracted rows lock (releasable_pages)
        while need > free_pages:
            req = self._pick_victim(kept, decoding)
            if req is None:
                break
            kept.remove(req)
            if req in decoding:
                decoding.remove(req)
                need -= allocator.pages_needed(req.row, self.decode_end(req))
            free_pages += allocator.releasable_pages(req.row, released)
            retracted.append(req)
        batch = [r for r in kept if r in decoding]
        ends = list(map(self.decode_end, batch))
        return DecodeDecision(batch=batch, retracted=retracted, fits=need <= free_pages, ends=ends)

    def _pick_victim(self, kept: Sequence[Request], decoding: set[Request]) -> Request | None:
        """The newest request, unless it is the last decoding one (then the newest prefill)."""
        for req in reversed(kept):
            if req.is_prefilling or len(decoding) > 1:
                return req
        return None
