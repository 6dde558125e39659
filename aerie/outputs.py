"""The columnar `StepOutputs` message: `OutputsWriter` (the scheduler) and `read_outputs` (the
frontends, tests).

A step's outputs for a frontend's requests travel as one message of a few byte columns, not one
object per request: at a few hundred streams a step, per-request objects cost the scheduler and
the frontend more than the tokens themselves.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from dataclasses import dataclass

from aerie.codec import unpack_floats, unpack_ids
from aerie.messages import FinishReason, StepOutputs


class _Columns:
    """One frontend's columns while a step's outputs are written."""

    def __init__(self) -> None:
        self.rids: list[str] = []
        self.num_tokens = array("i")
        self.spec_verify_ct = array("i")
        self.cached_tokens = array("i")
        self.token_ids = bytearray()
        self.logprobs: list[bytes | None] = []  # per request; None: it did not ask
        self.finishes: dict[str, FinishReason] = {}


class OutputsWriter:
    """Collects per-request outputs, grouped by frontend, until `take`."""

    def __init__(self) -> None:
        self._columns: dict[int, _Columns] = {}

    def add(
        self,
        frontend: int,
        rid: str,
        token_ids: bytes,
        spec_verify_ct: int = 0,
        cached_tokens: int = 0,
        logprobs: bytes | None = None,
        finish: FinishReason | None = None,
    ) -> None:
        """rid's new tokens (int32 bytes) and, when it asked, their logprobs (float32 bytes);
        finish: the step ended it."""
        columns = self._columns.get(frontend)
        if columns is None:
            columns = self._columns[frontend] = _Columns()
        columns.rids.append(rid)
        columns.num_tokens.append(len(token_ids) // 4)
        columns.spec_verify_ct.append(spec_verify_ct)
        columns.cached_tokens.append(cached_tokens)
        columns.token_ids += token_ids
        columns.logprobs.append(logprobs)
        if finish is not None:
            columns.finishes[rid] = finish

    def __bool__(self) -> bool:
        return bool(self._columns)

    def take(self) -> list[StepOutputs]:
        """One message per frontend with outputs (in frontend order); the writer is empty after."""
        messages = [_message(frontend, c) for frontend, c in sorted(self._columns.items())]
        self._columns = {}
        return messages


def _message(frontend: int, c: _Columns) -> StepOutputs:
    logprobs = return_logprob = b""
    if any(lp is not None for lp in c.logprobs):
        logprobs = b"".join(lp for lp in c.logprobs if lp is not None)
        return_logprob = bytes(lp is not None for lp in c.logprobs)
    return StepOutputs(
        frontend=frontend,
        rids=c.rids,
        num_tokens=c.num_tokens.tobytes(),
        token_ids=bytes(c.token_ids),
        spec_verify_ct=_unless_zero(c.spec_verify_ct),
        cached_tokens=_unless_zero(c.cached_tokens),
        logprobs=logprobs,
        return_logprob=return_logprob,
        finishes=c.finishes,
    )


def _unless_zero(column: array) -> bytes:
    """An int32 column's bytes, or none when every value is 0 (no speculation, no cache hit:
    the common case costs nothing to send)."""
    return column.tobytes() if any(column) else b""


@dataclass(slots=True)
class RequestOutput:
    """One request's share of a StepOutputs message."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]  # empty unless the request asked for them
    spec_verify_ct: int
    cached_tokens: int
    finish: FinishReason | None


def read_outputs(message: StepOutputs) -> Iterator[RequestOutput]:
    """Each request's outputs, in the message's order."""
    counts = unpack_ids(message.num_tokens)
    ids = unpack_ids(message.token_ids)
    logprobs = unpack_floats(message.logprobs) if message.logprobs else []
    asked = message.return_logprob
    zeros = [0] * len(message.rids)
    verify = unpack_ids(message.spec_verify_ct) if message.spec_verify_ct else zeros
    cached = unpack_ids(message.cached_tokens) if message.cached_tokens else zeros
    finishes = message.finishes
    end = logprobs_end = 0
    for i, rid in enumerate(message.rids):
        start, end = end, end + counts[i]
        request_logprobs: list[float] = []
        if asked and asked[i]:
            logprobs_start, logprobs_end = logprobs_end, logprobs_end + counts[i]
            request_logprobs = logprobs[logprobs_start:logprobs_end]
        yield RequestOutput(
            rid, ids[start:end], request_logprobs, verify[i], cached[i], finishes.get(rid)
        )
