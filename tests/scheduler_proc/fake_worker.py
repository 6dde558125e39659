"""A fake GPU worker for scheduler tests: a KV store addressed by the plan's slots.

The "model" is `next_token(seq)`, a deterministic function of the whole sequence, and the
sequence is read back from the fake KV through the slots the scheduler assigned. A slot handed
to two live requests, a wrong prefix length or KV read beyond what was written changes the
tokens, so comparing with `reference_output` catches scheduler bugs. Decode may accept several
tokens (speculation): rejected headroom slots are filled with garbage.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass

from aerie.codec import pack_floats, pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import (
    FinishReason,
    ForwardPlan,
    RequestStart,
    SamplingParams,
    StepOutputs,
    StepResult,
    TokenizedRequest,
)
from aerie.outputs import read_outputs
from scheduler_proc.scheduler import Scheduler

VOCAB = 50
GARBAGE = -1000


def next_token(seq: list[int]) -> int:
    """A hash of the whole ordered sequence."""
    h = 17
    for token in seq:
        h = (h * 31 + token + 7) % 1_000_003
    return h % VOCAB


def reference_output(prompt: list[int], max_new: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """What one request run alone produces."""
    seq, out = list(prompt), []
    while len(out) < max_new:
        token = next_token(seq)
        out.append(token)
        seq.append(token)
        if token in stop_ids:
            break
    return out


class FakeWorker:
    """accept(step, row) -> tokens a decode accepts (clipped to the reserved headroom).

    Like the real worker it keeps each row's last token and committed length: a decode plan
    carries neither. `run` applies a plan's effects at once (as the GPU would, in plan order),
    so a harness may run step N+1 before applying step N's result (the overlap schedule)."""

    def __init__(self, accept: Callable[[int, int], int] | None = None, alloc_len: int = 1) -> None:
        """alloc_len: positions a decode step writes from the committed length (the
        scheduler's decode_alloc_len): the input token, the accepted drafts, then garbage."""
        self.alloc_len = alloc_len
        self.kv: dict[int, int] = {}  # slot -> token
        self.row_slots: dict[int, dict[int, int]] = {}  # row -> position -> slot
        self.row_token: dict[int, int] = {}  # row -> last token (no KV yet)
        self.row_len: dict[int, int] = {}  # row -> committed length
        self.accept = accept or (lambda step, row: 1)
        self.step = 0
        self.starts: list[tuple[int, int]] = []  # (row, output_len) per RequestStart

    def run(self, plan: ForwardPlan) -> StepResult:
        self.step += 1
        for start in plan.starts:
            self.row_slots[start.row], self.row_len[start.row] = {}, 0
            self.row_token.pop(start.row, None)
            self.starts.append((start.row, start.output_len))
        rows = unpack_ids(plan.rows)
        slot_starts, slot_lens = unpack_ids(plan.slot_starts), unpack_ids(plan.slot_lens)
        slots = unpack_ids(plan.slots)
        offset = 0
        started = {start.row for start in plan.starts}
        for row, first, n in zip(rows, slot_starts, slot_lens, strict=True):
            assert row > 0 and row in self.row_slots, "row used without a RequestStart"
            if row in started:  # a new row starts on the prefix it was assigned (cached KV)
                assert first == 0, "a new row's slots start after position 0"
                self.row_len[row] = unpack_ids(plan.committed_lens)[rows.index(row)]
            for k, slot in enumerate(slots[offset : offset + n]):
                assert slot != 0
                self.row_slots[row][first + k] = slot
            offset += n
        if plan.mode == "extend":
            per_row = self._extend(plan, rows)
        else:
            per_row = [self._decode(row) for row in rows]
        num_verify = [1 if plan.mode == "decode" else 0 for _ in rows]
        token_ids = [t for tokens in per_row for t in tokens]
        return StepResult(
            plan_id=plan.plan_id,
            num_tokens=pack_ids([len(t) for t in per_row]),
            token_ids=pack_ids(token_ids),
            logprobs=pack_floats([-float(t) for t in token_ids]),
            num_verify=pack_ids(num_verify),
        )

    def _sequence(self, row: int, length: int) -> list[int]:
        positions = self.row_slots[row]
        return [self.kv[positions[p]] for p in range(length)]

    def _extend(self, plan: ForwardPlan, rows: list[int]) -> list[list[int]]:
        ids = unpack_ids(plan.input_ids)
        committed_lens, extend_lens = unpack_ids(plan.committed_lens), unpack_ids(plan.extend_lens)
        sample = unpack_ids(plan.sample)
        out, offset = [], 0
        for i, row in enumerate(rows):
            chunk = ids[offset : offset + extend_lens[i]]
            offset += extend_lens[i]
            assert self.row_len[row] == committed_lens[i], "extend after the wrong prefix"
            seq = self._sequence(row, committed_lens[i]) + chunk
            for p, token in enumerate(chunk):
                self.kv[self.row_slots[row][committed_lens[i] + p]] = token
            self.row_len[row] = len(seq)
            if not sample[i]:
                out.append([])
                continue
            self.row_token[row] = next_token(seq)
            out.append([self.row_token[row]])
        return out

    def _decode(self, row: int) -> list[int]:
        prefix = self.row_len[row]
        seq = self._sequence(row, prefix) + [self.row_token[row]]
        positions = range(prefix, prefix + self.alloc_len)
        missing = [p for p in positions if p not in self.row_slots[row]]
        assert not missing, f"row {row}: decode writes positions {missing} that have no slot"
        num_accept = max(1, min(self.accept(self.step, row), self.alloc_len))
        tokens = []
        for _ in range(num_accept):
            tokens.append(next_token(seq))
            seq.append(tokens[-1])
        slots = [self.row_slots[row][prefix + k] for k in range(self.alloc_len)]
        for k, slot in enumerate(slots):  # the input token, accepted drafts, then garbage
            self.kv[slot] = seq[prefix + k] if k < num_accept else GARBAGE
        self.row_len[row] = prefix + num_accept
        self.row_token[row] = tokens[-1]
        return tokens


def make_config(
    page_size=1, max_running=8, chunk=64, context_length=None, overlap=True
) -> AerieConfig:
    return AerieConfig().replace(
        cache={"page_size": page_size},
        scheduler={
            "max_running_requests": max_running,
            "chunked_prefill_size": chunk,
            "disable_overlap_schedule": not overlap,
        },
        model={"context_length": context_length},
    )


def make_request(rid: str, prompt: list[int], **sampling) -> TokenizedRequest:
    return TokenizedRequest(
        rid=rid,
        input_ids=pack_ids(prompt),
        sampling=SamplingParams(**sampling),
        return_logprob=True,
    )


class Collector:
    """Reassembles each rid's output ids, logprobs and finish from the scheduler's outputs."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.logprobs: dict[str, list[float]] = defaultdict(list)
        self.finish: dict[str, FinishReason] = {}

    def add(self, messages: list[StepOutputs]) -> None:
        for message in messages:
            for out in read_outputs(message):
                assert out.rid not in self.finish, "outputs after finish"
                self.outputs[out.rid] += out.token_ids
                self.logprobs[out.rid] += out.logprobs
                if out.finish is not None:
                    self.finish[out.rid] = out.finish


@dataclass(frozen=True)
class Entry:
    """One request's share of a plan, read back from the columns (tests only)."""

    rid: str
    row: int
    committed_len: int  # extend only (decode: -1, the worker knows it)
    input_ids: list[int]  # extend only
    out_slots: list[int]  # the slots newly assigned to the request this step
    slot_start: int  # the position of the first of them
    sample: bool
    next_input_id: int
    start: RequestStart | None

    @property
    def num_tokens(self) -> int:
        """Tokens it runs this step: its chunk, or one for a decode."""
        return len(self.input_ids) if self.input_ids else 1


@dataclass(frozen=True)
class Planned:
    plan: ForwardPlan
    requests: list[Entry]

    @property
    def mode(self) -> str:
        return self.plan.mode


def plan_entries(plan: ForwardPlan, rids: list[str]) -> Planned:
    rows = unpack_ids(plan.rows)
    lens, starts = unpack_ids(plan.slot_lens), unpack_ids(plan.slot_starts)
    slots = unpack_ids(plan.slots)
    extend = plan.mode == "extend"
    ids = unpack_ids(plan.input_ids)
    n = len(rows)
    extend_lens = unpack_ids(plan.extend_lens) if extend else [0] * n
    committed_lens = unpack_ids(plan.committed_lens) if extend else [-1] * n
    sample = unpack_ids(plan.sample) if extend else [1] * n
    next_ids = unpack_ids(plan.next_input_ids) if extend else [-1] * n
    by_row = {start.row: start for start in plan.starts}
    entries, slot_offset, id_offset = [], 0, 0
    for i, (rid, row) in enumerate(zip(rids, rows, strict=True)):
        entries.append(
            Entry(
                rid=rid,
                row=row,
                committed_len=committed_lens[i],
                input_ids=ids[id_offset : id_offset + extend_lens[i]],
                out_slots=slots[slot_offset : slot_offset + lens[i]],
                slot_start=starts[i],
                sample=bool(sample[i]),
                next_input_id=next_ids[i],
                start=by_row.get(row),
            )
        )
        slot_offset += lens[i]
        id_offset += extend_lens[i]
    return Planned(plan, entries)


def run_to_end(
    sched: Scheduler,
    worker: FakeWorker,
    collector: Collector,
    on_step: Callable[[int, Planned], None] | None = None,
    max_steps: int = 5000,
) -> list[Planned]:
    """Run until idle, keeping up to `sched.max_in_flight` plans in flight like the scheduler
    process does: the worker runs a plan when it is sent, its result is applied later.
    on_step(n, planned) runs after the n-th plan's result is applied."""
    plans: list[Planned] = []
    in_flight: deque[tuple[ForwardPlan, StepResult]] = deque()
    collector.add(sched.take_outputs())
    while sched.has_work() or in_flight:
        assert len(plans) < max_steps, "scheduler did not finish"
        while sched.can_plan() and sched.has_work():
            plan = sched.next_plan()
            if plan is None:
                break
            plans.append(plan_entries(plan, sched.plan_rids(plan)))
            in_flight.append((plan, worker.run(plan)))
        assert in_flight, "scheduler has work but made no plan"
        plan, result = in_flight.popleft()
        collector.add(sched.apply_result(plan, result))
        if on_step is not None:
            number = next(i for i, p in enumerate(plans) if p.plan is plan) + 1
            on_step(number, plans[number - 1])
            collector.add(sched.take_outputs())
    collector.add(sched.take_outputs())
    assert sched.allocator.is_whole(), "rows or KV leaked"
    return plans
