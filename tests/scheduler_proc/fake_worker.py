"""A fake GPU worker for scheduler tests: a KV store addressed by the plan's slots.

The "model" is `next_token(seq)`, a deterministic function of the whole sequence, and the
sequence is read back from the fake KV through the slots the scheduler assigned. A slot handed
to two live requests, a wrong prefix length or KV read beyond what was written changes the
tokens, so comparing with `reference_output` catches scheduler bugs. Decode may accept several
tokens (speculation): rejected headroom slots are filled with garbage.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from aerie.codec import pack_floats, pack_ids, unpack_ids
from aerie.config import AerieConfig
from aerie.messages import (
    FinishReason,
    ForwardPlan,
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
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
    """accept(step, rid) -> tokens a decode accepts (clipped to the reserved headroom)."""

    def __init__(self, accept: Callable[[int, str], int] | None = None) -> None:
        self.kv: dict[int, int] = {}  # slot -> token
        self.row_slots: dict[int, dict[int, int]] = {}  # row -> position -> slot
        self.row_rid: dict[int, str] = {}
        self.accept = accept or (lambda step, rid: 1)
        self.step = 0
        self.starts: list[tuple[str, int]] = []  # (rid, output_len) per RequestStart

    def run(self, plan: ForwardPlan) -> StepResult:
        self.step += 1
        num_tokens, token_ids, num_verify = [], [], []
        for entry in plan.requests:
            tokens = self._run_entry(plan.mode, entry)
            num_tokens.append(len(tokens))
            token_ids.extend(tokens)
            num_verify.append(1 if plan.mode == "decode" and tokens else 0)
        return StepResult(
            plan_id=plan.plan_id,
            num_tokens=pack_ids(num_tokens),
            token_ids=pack_ids(token_ids),
            logprobs=pack_floats([-float(t) for t in token_ids]),
            num_verify=pack_ids(num_verify),
        )

    def _run_entry(self, mode: str, entry) -> list[int]:
        row = entry.req_pool_idx
        assert row > 0
        if entry.start is not None:
            self.row_slots[row], self.row_rid[row] = {}, entry.rid
            self.starts.append((entry.rid, entry.start.output_len))
        assert self.row_rid[row] == entry.rid, "row used without a RequestStart"
        ids, slots = unpack_ids(entry.input_ids), unpack_ids(entry.out_slots)
        assert 0 not in slots and len(slots) >= len(ids)
        positions = self.row_slots[row]
        for offset, slot in enumerate(slots):
            positions[entry.prefix_len + offset] = slot
        seq = [self.kv[positions[p]] for p in range(entry.prefix_len)] + ids
        for slot, token in zip(slots, ids, strict=False):
            self.kv[slot] = token
        if not entry.sample:
            return []
        if mode == "extend":
            return [next_token(seq)]
        num_accept = max(1, min(self.accept(self.step, entry.rid), len(slots)))
        tokens = []
        for _ in range(num_accept):
            tokens.append(next_token(seq))
            seq.append(tokens[-1])
        for slot, token in zip(slots[1:num_accept], tokens[:-1], strict=True):
            self.kv[slot] = token  # accepted drafts have KV
        for slot in slots[num_accept:]:
            self.kv[slot] = GARBAGE  # rejected tree nodes
        return tokens


def make_config(page_size=1, max_running=8, chunk=64, context_length=None) -> AerieConfig:
    return AerieConfig().replace(
        cache={"page_size": page_size},
        scheduler={"max_running_requests": max_running, "chunked_prefill_size": chunk},
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
    """Reassembles each rid's output ids, logprobs and finish from the scheduler's deltas."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = defaultdict(list)
        self.logprobs: dict[str, list[float]] = defaultdict(list)
        self.finish: dict[str, FinishReason] = {}
        self.num_starts: dict[str, int] = defaultdict(int)

    def add(self, deltas) -> None:
        if deltas is None:
            return
        for d in deltas.deltas:
            assert d.rid not in self.finish, "delta after finish"
            self.outputs[d.rid] += unpack_ids(d.token_ids)
            self.logprobs[d.rid] += [float(x) for x in memoryview(d.logprobs).cast("f")]
            self.num_starts[d.rid] += d.start is not None
            assert d.completion_tokens == len(self.outputs[d.rid])
            if d.finish is not None:
                self.finish[d.rid] = d.finish


def run_to_end(
    sched: Scheduler,
    worker: FakeWorker,
    collector: Collector,
    on_step: Callable[[int, ForwardPlan], None] | None = None,
    max_steps: int = 5000,
) -> list[ForwardPlan]:
    plans = []
    collector.add(sched.take_deltas())
    while sched.has_work():
        assert len(plans) < max_steps, "scheduler did not finish"
        plan = sched.next_plan()
        assert plan is not None, "scheduler has work but made no plan"
        plans.append(plan)
        collector.add(sched.apply_result(plan, worker.run(plan)))
        if on_step is not None:
            on_step(len(plans), plan)
            collector.add(sched.take_deltas())
    collector.add(sched.take_deltas())
    return plans
