"""The scheduler's view of one request and its state machine.

    WAITING --admit--> RUNNING (prefill in chunks, then decode) --finish/abort--> FINISHED
       ^                  |
       +----retract-------+   (back to the front of the queue, outputs kept)

A RUNNING request holds a request row (`row`: its index in `req_to_token`) and KV for
positions [0, committed_len) (plus the headroom reserved for the decode steps in flight). A
request that finishes while a plan in flight still holds it keeps its row and KV until that
plan's result is applied.
`fill_ids` is what prefill runs: the prompt, or prompt + outputs so far after a retraction.
While `committed_len < len(fill_ids)` it is prefilling; afterwards it decodes, and then
`committed_len == len(prompt_ids) + len(output_ids) - 1`: every token but the newest has KV.
"""

from __future__ import annotations

import enum
from dataclasses import InitVar, dataclass, field

from aerie.messages import FinishReason, SamplingParams
from scheduler_proc.adaptive import kind


class ReqState(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """Mutable per-request state, owned by the `Scheduler`. Ids are plain int lists (CPU)."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    frontend: int = 0  # the frontend process that owns it (`TokenizedRequest.frontend`)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)  # aligned with output_ids
    state: ReqState = ReqState.WAITING
    row: int = 0  # 0: holds no row
    # The committed length: positions [0, committed_len) have KV written, or are written by a
    # prefill chunk in flight (a chunk counts when it is planned, decode tokens when their
    # result is applied). The plan's committed_lens and the worker's per-row committed length
    # are the same quantity; ForwardBatch.seq_lens is the length after a forward.
    committed_len: int = 0
    fill_ids: list[int] = field(default_factory=list)
    spec_verify_ct: int = 0
    # Prompt tokens its first admission reused from the prefix cache (None: not admitted yet).
    cached_tokens: int | None = None
    # What adaptive speculation learns its acceptance with (`adaptive.kind`): its sampling.
    accept_kind: tuple = field(init=False)
    # Whether the draft's state follows the request's last token: false after a plain decode
    # step (adaptive speculation), true again once an iteration's draft extend has run.
    draft_fresh: bool = True
    finish: FinishReason | None = None
    num_sent: int = 0  # output tokens already sent to the frontend
    needs_start: bool = True  # next plan entry carries a RequestStart (new row)
    # Plans in flight (sent, result not applied) that hold the request: all of them, those
    # that sample a token for it, and its decode steps among them.
    in_flight: int = 0
    samples_in_flight: int = 0
    decodes_in_flight: int = 0
    stop_ids: frozenset[int] | None = None  # ids that end it (FinishChecker fills it once)
    # The model's context length (None: unlimited); only sets max_output_len.
    context_length: InitVar[int | None] = None
    # Outputs it may have in all: max_new_tokens, fewer when the context fills first. Constant,
    # so the per-step checks compare one length (`num_tokens + n >= context_length` is
    # `len(output_ids) + n >= context_length - len(prompt_ids)`).
    max_output_len: int = field(init=False)

    def __post_init__(self, context_length: int | None) -> None:
        if not self.fill_ids:
            self.fill_ids = list(self.prompt_ids)
        self.max_output_len = self.sampling.max_new_tokens
        self.accept_kind = kind(self.sampling)
        if context_length is not None:
            self.max_output_len = min(self.max_output_len, context_length - len(self.prompt_ids))

    @property
    def is_prefilling(self) -> bool:
        return self.committed_len < len(self.fill_ids)

    @property
    def num_remaining_fill(self) -> int:
        return len(self.fill_ids) - self.committed_len

    @property
    def num_remaining_new_tokens(self) -> int:
        """Output tokens it may still generate (max_new_tokens less what it has)."""
        return max(self.sampling.max_new_tokens - len(self.output_ids), 0)

    @property
    def num_tokens(self) -> int:
        """Prompt plus outputs so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    def reset_for_retract(self) -> None:
        """Back to WAITING without a row or KV; the next prefill recomputes prompt + outputs."""
        self.state = ReqState.WAITING
        self.row = 0
        self.committed_len = 0
        self.fill_ids = self.prompt_ids + self.output_ids
        self.needs_start = True
        self.draft_fresh = True  # the draft's prefill runs again
