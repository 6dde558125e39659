"""Per-rid request state: collects `TextDelta`s until a request finishes. Socket-free.

`RequestTracker.add(rid)` registers a request; `feed(TextDeltas)` appends each delta to its
request's state and wakes the consumer; `RequestState.chunks()` is an async iterator of
coalesced `Chunk`s that ends after the finishing delta. A request leaves the tracker (and stops
counting as in flight) when its finishing delta arrives or when `abort(rid)` drops it locally;
deltas for rids the tracker does not know (already aborted, health checks) are ignored with a
debug log. Everything runs on one asyncio loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aerie.codec import unpack_floats, unpack_ids
from aerie.messages import FinishReason, TextDelta, TextDeltas

log = logging.getLogger(__name__)

ABORTED_LOCALLY = FinishReason(type="abort", message="aborted by the client")


@dataclass
class Chunk:
    """What arrived for one request since the consumer last looked (coalesced deltas).

    The remaining fields snapshot the request right after this chunk: `text_end` / `ids_end`
    are the lengths of the cumulative text / output ids, `at` the arrival time.
    """

    text: str
    output_ids: list[int]
    logprobs: list[float]
    finish: FinishReason | None
    text_end: int = 0
    ids_end: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    at: float = 0.0


@dataclass
class RequestState:
    """Everything received for one request so far; mutated only by the tracker."""

    rid: str
    created_at: float = field(default_factory=time.perf_counter)
    first_output_at: float | None = None
    finished_at: float | None = None
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    spec_verify_ct: int = 0
    _pending: list[Chunk] = field(default_factory=list)
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    def e2e_latency(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.perf_counter()
        return end - self.created_at

    def ttft(self) -> float | None:
        return None if self.first_output_at is None else self.first_output_at - self.created_at

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Yield coalesced chunks as they arrive; the last one carries `finish`."""
        while True:
            await self._event.wait()
            self._event.clear()
            if not self._pending:
                continue
            pending, self._pending = self._pending, []
            chunk = _coalesce(pending)
            yield chunk
            if chunk.finish is not None:
                return

    async def wait_finished(self) -> RequestState:
        """Wait until the request finishes (or is aborted); returns self."""
        async for _ in self.chunks():
            pass
        return self

    def _apply(self, delta: TextDelta) -> Chunk:
        ids = unpack_ids(delta.token_ids)
        logprobs = unpack_floats(delta.logprobs) if delta.logprobs else []
        if self.first_output_at is None and (ids or delta.text):
            self.first_output_at = time.perf_counter()
        self.text += delta.text
        self.output_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.prompt_tokens = delta.prompt_tokens or self.prompt_tokens
        self.completion_tokens = max(delta.completion_tokens, len(self.output_ids))
        self.spec_verify_ct = delta.spec_verify_ct or self.spec_verify_ct
        return self._push(delta.text, ids, logprobs, delta.finish)

    def _push(
        self, text: str, ids: list[int], logprobs: list[float], finish: FinishReason | None
    ) -> Chunk:
        now = time.perf_counter()
        if finish is not None:
            self.finish = finish
            self.finished_at = now
        chunk = Chunk(
            text, ids, logprobs, finish, len(self.text), len(self.output_ids),
            self.prompt_tokens, self.completion_tokens, self.spec_verify_ct, now,
        )  # fmt: skip
        self._pending.append(chunk)
        self._event.set()
        return chunk


def _coalesce(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return dataclasses.replace(
        chunks[-1],
        text="".join(c.text for c in chunks),
        output_ids=[i for c in chunks for i in c.output_ids],
        logprobs=[p for c in chunks for p in c.logprobs],
    )


class RequestTracker:
    """rid -> RequestState for every request in flight.

    on_first_output(state) / on_finish(state) are optional hooks (metrics), called once per
    request from `feed` / `abort`.
    """

    def __init__(
        self,
        on_first_output: Callable[[RequestState], None] | None = None,
        on_finish: Callable[[RequestState], None] | None = None,
    ) -> None:
        self._states: dict[str, RequestState] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_first_output = on_first_output
        self._on_finish = on_finish

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def add(self, rid: str, prompt_tokens: int = 0) -> RequestState:
        """Register a new request. Raises ValueError if rid is already in flight."""
        if rid in self._states:
            raise ValueError(f"rid {rid!r} is already in flight")
        state = RequestState(rid=rid, prompt_tokens=prompt_tokens)
        self._states[rid] = state
        self._idle.clear()
        return state

    def feed(self, message: TextDeltas) -> None:
        """Apply each delta to its request; finished requests leave the tracker."""
        for delta in message.deltas:
            state = self._states.get(delta.rid)
            if state is None:
                log.debug("ignoring a delta for unknown rid %s", delta.rid)
                continue
            had_output = state.first_output_at is not None
            state._apply(delta)
            if not had_output and state.first_output_at is not None and self._on_first_output:
                self._on_first_output(state)
            if state.finished:
                self._remove(state)

    def abort(self, rid: str, finish: FinishReason = ABORTED_LOCALLY) -> bool:
        """Finish rid locally (its consumer sees `finish`); False if it was not in flight."""
        state = self._states.get(rid)
        if state is None:
            return False
        state._push("", [], [], finish)
        self._remove(state)
        return True

    def rids(self) -> list[str]:
        return list(self._states)

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is in flight; False if timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _remove(self, state: RequestState) -> None:
        del self._states[state.rid]
        if not self._states:
            self._idle.set()
        if self._on_finish:
            self._on_finish(state)
