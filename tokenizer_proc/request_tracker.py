"""Per-rid request state: turns the scheduler's `StepOutputs` into text and collects them
until a request finishes. Socket-free.

Requests are keyed by the engine's `rid`; a client's own rid is only echoed back, and unique
among the requests in flight of its scope (`docs/serving.md`, "Two kinds of request id").
Each request's ids are detokenized here, by its own `IncrementalDetokenizer`, once per token.
`RequestState.chunks()` yields coalesced `Chunk`s until the finishing output; outputs for
unknown rids are ignored. Everything runs on one asyncio loop; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aerie.messages import FinishReason, StepOutputs
from aerie.outputs import RequestOutput, read_outputs
from tokenizer_proc.detokenize import IncrementalDetokenizer

log = logging.getLogger(__name__)

ABORTED_LOCALLY = FinishReason(type="abort", message="aborted by the client")
# Requests the server ends because it stops (drain timeout, Shutdown); the HTTP API answers
# them with a 503 (an error event in a stream), so that clients retry elsewhere or later.
SERVER_STOPPING = FinishReason("abort", message="the server is shutting down; retry the request")
# JSON has no -Infinity: a token of zero probability (and anything below) reports this
# logprob, as OpenAI does. NaN is kept, so that the strict JSON encoding fails loudly.
LOGPROB_FLOOR = -9999.0


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
    cached_tokens: int = 0
    at: float = 0.0


@dataclass
class RequestState:
    """Everything received for one request so far; mutated only by the tracker."""

    rid: str
    client_rid: str | None = None  # the client's own id, echoed back; None: none given
    scope: object = None  # the client namespace of client_rid (HTTP, or a ZMQ connection)
    seed: int | None = None  # the sampling seed the request runs with (reported in meta_info)
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
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    detokenizer: IncrementalDetokenizer | None = None  # None: outputs carry no text
    _pending: Chunk | None = None  # what arrived since the consumer last looked
    _event: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def public_id(self) -> str:
        """The id the client sees: its own rid if it gave one, else the engine's."""
        return self.client_rid if self.client_rid is not None else self.rid

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
            chunk, self._pending = self._pending, None
            if chunk is None:
                continue
            yield chunk
            if chunk.finish is not None:
                return

    async def wait_finished(self) -> RequestState:
        """Wait until the request finishes (or is aborted); returns self."""
        async for _ in self.chunks():
            pass
        return self

    def _apply(self, output: RequestOutput) -> None:
        ids, logprobs, finish = output.token_ids, output.logprobs, output.finish
        if logprobs and min(logprobs) < LOGPROB_FLOOR:
            logprobs = [LOGPROB_FLOOR if lp < LOGPROB_FLOOR else lp for lp in logprobs]
        text = self.detokenizer.step(ids, finish) if self.detokenizer is not None else ""
        if self.first_output_at is None and (ids or text):
            self.first_output_at = time.perf_counter()
        self.text += text
        self.output_ids.extend(ids)
        self.logprobs.extend(logprobs)
        self.completion_tokens = len(self.output_ids)
        self.spec_verify_ct = output.spec_verify_ct or self.spec_verify_ct
        self.cached_tokens = output.cached_tokens or self.cached_tokens
        self._push(text, ids, logprobs, finish)

    def _push(
        self, text: str, ids: list[int], logprobs: list[float], finish: FinishReason | None
    ) -> None:
        """Add a delta's output (ids and logprobs: lists the chunk may keep) to the pending
        chunk, and snapshot the request in it. Deltas that arrive before the consumer looks
        are appended to that one chunk in place: a consumer that falls behind (several
        tokens per event) costs one chunk per event, not a chunk per delta and a merge."""
        now = time.perf_counter()
        if finish is not None:
            self.finish = finish
            self.finished_at = now
        chunk = self._pending
        if chunk is None:
            chunk = self._pending = Chunk(text, ids, logprobs, finish)
            self._event.set()
        else:
            chunk.text += text
            chunk.output_ids += ids
            chunk.logprobs += logprobs
            chunk.finish = finish
        chunk.text_end, chunk.ids_end = len(self.text), len(self.output_ids)
        chunk.prompt_tokens, chunk.completion_tokens = self.prompt_tokens, self.completion_tokens
        chunk.spec_verify_ct, chunk.at = self.spec_verify_ct, now
        chunk.cached_tokens = self.cached_tokens


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
        self._client_rids: dict[tuple[object, str], str] = {}  # (scope, client rid) -> rid
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_first_output = on_first_output
        self._on_finish = on_finish

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def __contains__(self, rid: str) -> bool:
        return rid in self._states

    def client_rid_in_flight(self, scope: object, client_rid: str) -> bool:
        return (scope, client_rid) in self._client_rids

    def add(
        self,
        rid: str,
        prompt_tokens: int = 0,
        client_rid: str | None = None,
        scope: object = None,
        seed: int | None = None,
        detokenizer: IncrementalDetokenizer | None = None,
    ) -> RequestState:
        """Register a new request (detokenizer: makes its text). Raises ValueError if rid, or
        client_rid within its scope, is already in flight."""
        if rid in self._states:
            raise ValueError(f"rid {rid!r} is already in flight")
        if client_rid is not None:
            if (scope, client_rid) in self._client_rids:
                raise ValueError(f"rid {client_rid!r} is already in flight")
            self._client_rids[(scope, client_rid)] = rid
        state = RequestState(
            rid, client_rid, scope, seed=seed, prompt_tokens=prompt_tokens, detokenizer=detokenizer
        )
        self._states[rid] = state
        self._idle.clear()
        return state

    def feed(self, message: StepOutputs) -> None:
        """Apply each request's outputs to it; finished requests leave the tracker."""
        for output in read_outputs(message):
            state = self._states.get(output.rid)
            if state is None:
                log.debug("ignoring outputs for unknown rid %s", output.rid)
                continue
            had_output = state.first_output_at is not None
            state._apply(output)
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

    def describe(self) -> list[dict[str, str | int | float | bool]]:
        """One entry per request in flight, oldest first, for a debug view: its ids, age and
        what arrived for it (counts, no text); `chunk_pending`: output its consumer has not
        taken yet."""
        now = time.perf_counter()
        return [
            {
                "rid": state.rid,
                "id": state.public_id,
                "age_s": round(now - state.created_at, 3),
                "output_tokens": len(state.output_ids),
                "chunk_pending": state._pending is not None,
            }
            for state in self._states.values()
        ]

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until nothing is in flight; False if timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True

    def _remove(self, state: RequestState) -> None:
        del self._states[state.rid]
        if state.client_rid is not None:
            del self._client_rids[(state.scope, state.client_rid)]
        if not self._states:
            self._idle.set()
        if self._on_finish:
            self._on_finish(state)
