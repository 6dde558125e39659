"""`Frontend`: the socket-free core the HTTP and ZMQ frontends share.

It validates and tokenizes request bodies, assigns rids and the seeds of requests that bring
none, registers them with the `RequestTracker` and hands `TokenizedRequest`s to a `Backend`
(the real process sends them to the scheduler; tests pass a fake that feeds `StepOutputs`
back into `frontend.tracker`). It also holds the lifecycle flags (ready, draining) and the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
import time
import uuid
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError

from aerie.codec import pack_ids
from aerie.messages import FinishReason, SamplingParams, TokenizedRequest
from aerie.process import process_alive
from tokenizer_proc.metrics import Metrics
from tokenizer_proc.request_tracker import ABORTED_LOCALLY, RequestState, RequestTracker
from tokenizer_proc.tokenizer import Tokenizer
from tokenizer_proc.validation import (
    GenerateBody,
    Limits,
    ValidationError,
    build_sampling_params,
    check_chat_size,
    check_prompt_ids,
)


class Backend(Protocol):
    """Where tokenized requests go (the schedulers in the real process)."""

    async def submit(self, request: TokenizedRequest) -> None: ...

    def abort(self, rid: str) -> Coroutine[Any, Any, None]:
        """The abort's send; called while the request is still in flight (a backend that routes
        requests looks up where this one went at the call, not when it is awaited)."""
        ...

    def finished(self, rid: str) -> None:
        """rid is done (finished, or aborted after its `abort` was made)."""
        ...

    async def describe(self, flush_cache: bool = False) -> list[dict[str, Any]]:
        """Where the engine holds each request, per scheduler (GET /debug/requests); with
        flush_cache, after each scheduler dropped its unused cached prefixes."""
        ...


HTTP_SCOPE = "http"  # HTTP clients have no identity: their rids share one namespace
MAX_RID_LEN = 256  # characters of a client-chosen rid (echoed in every stream event)
# Drawn seeds stay below 2^53 so that a client reading JSON numbers as doubles (JavaScript)
# sends back exactly the seed it was given.
DRAWN_SEED_BITS = 53
LIVENESS_TTL_S = 0.05  # requests at most this long after an engine process died get in


@dataclass(frozen=True)
class Prepared:
    """A validated, tokenized request ready to submit. rid: the engine's id (generated);
    client_rid: the client's own id in `scope`, echoed back, or None."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    client_rid: str | None = None
    scope: object = HTTP_SCOPE


class Frontend:
    """State shared by the HTTP and ZMQ frontends; one per tokenizer process."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: Limits,
        backend: Backend,
        model_name: str,
        random_seed: int = 0,
        index: int = 0,
        open_flag: Any = None,
    ) -> None:
        """random_seed (`--random-seed`) starts the sequence of seeds given to requests that
        bring none: a restarted server hands out the same sequence (in the order requests
        finish tokenizing). index: this frontend's among several (`--tokenizer-worker-num`);
        each draws its own sequence of seeds. open_flag: the launcher's shared flag (a
        multiprocessing Value) that opens every frontend at once; None: open when ready."""
        self.tokenizer = tokenizer
        self.open_flag = open_flag
        self.limits = limits
        self.backend = backend
        self.model_name = model_name
        self.metrics = Metrics(index)
        self.index = index
        self._seeds = random.Random(random_seed if index == 0 else f"{random_seed}/{index}")
        self.tracker = RequestTracker(
            on_first_output=self.metrics.observe_first_output,
            on_finish=self.on_finish,
        )
        self.ready = False
        self.draining = False
        self.pids: dict[str, int] = {}
        self._gone: str | None = None  # the first engine process found gone (for good)
        self._alive_at = -math.inf  # when every process was last seen alive
        self.server_info: dict[str, Any] = {}
        self._background: set[asyncio.Task] = set()
        # Tokenization runs here, off the event loop (the tokenizer releases the GIL).
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenize")

    # -- lifecycle ------------------------------------------------------------------------------

    def mark_ready(self, server_info: dict[str, Any], pids: dict[str, int] | None = None) -> None:
        """The engine is up; pids (name -> pid) are the processes it needs alive."""
        self.server_info = dict(server_info)
        self.pids = dict(pids or {})
        self._gone, self._alive_at = None, -math.inf
        self.ready = True

    def begin_drain(self) -> None:
        self.draining = True

    def gone_process(self, max_age_s: float = 0.0) -> str | None:
        """The engine process found gone, or None; the processes are looked up (/proc, about
        40 us each) unless all were seen alive within max_age_s."""
        now = time.monotonic()
        if self._gone is None and now - self._alive_at >= max_age_s:
            self._gone = next((n for n, pid in self.pids.items() if not process_alive(pid)), None)
            self._alive_at = now
        return self._gone

    def unhealthy_reason(self, max_age_s: float = 0.0) -> str | None:
        """Why the server cannot serve now (not ready, draining, a process gone), or None;
        max_age_s: how old a look at the engine's processes may be (`gone_process`)."""
        if not self.ready or (self.open_flag is not None and not self.open_flag.value):
            return "the engine is not ready yet"
        gone = self.gone_process(max_age_s)
        if gone is not None:
            return f"the {gone} process is gone; the server is stopping"
        if self.draining:
            return "the server is draining; no new requests"
        return None

    @property
    def healthy(self) -> bool:
        return self.unhealthy_reason() is None

    def check_accepting(self, num_new: int = 1) -> None:
        """Raise a 503 ValidationError unless num_new more requests are accepted now. A
        request looks at the engine's processes at most every LIVENESS_TTL_S (health checks
        look every time)."""
        reason = self.unhealthy_reason(LIVENESS_TTL_S)
        if reason is not None:
            raise ValidationError(reason, status=503)
        limit = self.limits.max_in_flight
        if limit is not None and self.tracker.num_in_flight + num_new > limit:
            raise ValidationError(
                f"the server is overloaded ({self.tracker.num_in_flight} requests running or "
                "queued); retry shortly",
                status=503,
                retry_after=1,
            )

    # -- requests -------------------------------------------------------------------------------

    async def tokenize(self, text: str, param: str) -> list[int]:
        """Token ids of a text prompt, computed off the event loop (a long prompt would stall
        every other request and /health). A text too long for the context in any
        tokenization is refused without tokenizing."""
        return await self._encode(
            self.tokenizer.encode, text, len(text.encode("utf-8")), f"{param} is", param
        )

    async def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the chat template applied to messages, off the event loop, once
        `check_chat_size` has bounded what rendering and tokenizing them costs. Errors name
        the served model, never a filesystem path."""
        if not self.tokenizer.has_chat_template:
            raise ValidationError(
                f"the model {self.model_name!r} has no chat template; send "
                "the prompt as text to /v1/completions",
                "messages",
            )
        check_chat_size(messages, self.tokenizer.chat_tokens_per_message, self.limits)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.executor, self.tokenizer.encode_chat, messages)
        except TemplateError as e:  # the template refuses these messages (roles, their order)
            raise ValidationError(
                f"the chat template of {self.model_name!r} refuses these messages: {e}", "messages"
            ) from None

    async def _encode(self, encode, value, num_bytes: int, what: str, param: str) -> list[int]:
        """encode(value) in the tokenizer thread pool, after the byte pre-check (what: the
        subject of the error message, e.g. "text is")."""
        if num_bytes > self.limits.max_prompt_bytes:
            raise ValidationError(
                f"{what} {num_bytes} bytes: more than fits in the context of "
                f"{self.limits.context_length} tokens",
                param,
            )
        return await asyncio.get_running_loop().run_in_executor(self.executor, encode, value)

    async def prepare(
        self,
        prompt: str | list[int],
        sampling: dict[str, Any],
        client_rid: str | None,
        param: str,
        prefix: str = "sampling_params.",
        scope: object = HTTP_SCOPE,
    ) -> Prepared:
        """Tokenize (text) and validate one request; one without a seed gets the next drawn
        seed (greedy ones too, so every answer reports one). Raises ValidationError."""
        self.check_client_rid(client_rid, scope)
        ids = await self.tokenize(prompt, param) if isinstance(prompt, str) else prompt
        check_prompt_ids(ids, self.limits, param)
        params = build_sampling_params(sampling, len(ids), self.limits, prefix)
        if params.seed is None:
            params = dataclasses.replace(params, seed=self.draw_seed())
        return Prepared(uuid.uuid4().hex, ids, params, client_rid, scope)

    def draw_seed(self) -> int:
        """The next seed of this server's sequence, in [0, 2^DRAWN_SEED_BITS)."""
        return self._seeds.getrandbits(DRAWN_SEED_BITS)

    async def prepare_generate(
        self, body: GenerateBody, scope: object = HTTP_SCOPE
    ) -> list[Prepared]:
        param = "text" if body.items and isinstance(body.items[0].prompt, str) else "input_ids"
        return [
            await self.prepare(item.prompt, item.sampling, item.rid, param, scope=scope)
            for item in body.items
        ]

    def check_client_rid(self, client_rid: str | None, scope: object) -> None:
        if client_rid is None:
            return
        if not client_rid or len(client_rid) > MAX_RID_LEN:
            raise ValidationError(f"rid must be a string of 1 to {MAX_RID_LEN} characters", "rid")
        if self.tracker.client_rid_in_flight(scope, client_rid):
            raise ValidationError(f"rid {client_rid!r} is already in flight", "rid")

    async def submit(
        self, prepared: list[Prepared], stream: bool, return_logprob: bool
    ) -> list[RequestState]:
        """Register and send each request; returns their states in order. The overload and
        drain check runs here, with no await before the requests are registered, so requests
        that were tokenizing concurrently cannot all pass it (the routes check early too, to
        refuse before tokenizing)."""
        self.check_accepting(len(prepared))
        client_rids = [p.client_rid for p in prepared if p.client_rid is not None]
        if len(set(client_rids)) != len(client_rids):
            raise ValidationError("rids in a batch must be distinct", "rid")
        states: list[RequestState] = []
        try:
            for p in prepared:
                seed = p.sampling.seed
                detokenizer = self.tokenizer.detokenizer(p.sampling, stream, p.input_ids)
                states.append(
                    self.tracker.add(
                        p.rid, len(p.input_ids), p.client_rid, p.scope, seed, detokenizer
                    )
                )
        except ValueError as e:  # a client rid registered since prepare() checked it
            self.abort_unfinished(states)
            raise ValidationError(str(e), "rid") from None
        try:
            for p in prepared:
                ids = pack_ids(p.input_ids)
                await self.backend.submit(
                    TokenizedRequest(p.rid, ids, p.sampling, return_logprob, self.index)
                )
        except BaseException:
            self.abort_unfinished(states)
            raise
        return states

    def on_finish(self, state: RequestState) -> None:
        self.metrics.observe_finish(state)
        self.backend.finished(state.rid)

    def abort(self, rid: str, finish: FinishReason = ABORTED_LOCALLY) -> None:
        """Drop rid locally, its consumer seeing `finish`, and tell the backend (in the
        background; safe while cancelled)."""
        if rid not in self.tracker:
            return
        send = self.backend.abort(rid)  # made while the backend still knows the request
        self.tracker.abort(rid, finish)
        task = asyncio.get_running_loop().create_task(send)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def abort_unfinished(self, states: list[RequestState]) -> None:
        for state in states:
            if not state.finished:
                self.abort(state.rid)
