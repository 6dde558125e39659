"""RequestTracker: step outputs reach the right request (its detokenizer makes the text),
finish ends it, aborts and idleness."""

from __future__ import annotations

import asyncio
import random

from aerie.codec import pack_floats, pack_ids
from aerie.messages import FinishReason, StepOutputs
from aerie.outputs import OutputsWriter
from tokenizer_proc.request_tracker import RequestTracker


class Angles:
    """A detokenizer that writes id i as "<i>"."""

    def step(self, ids: list[int], finish: FinishReason | None = None) -> str:
        return "".join(f"<{i}>" for i in ids)


def delta(rid: str, ids: list[int], finish: str | None = None, spec_verify_ct: int = 0):
    return rid, ids, finish, spec_verify_ct


def step(*deltas) -> StepOutputs:
    """One step's outputs (logprob -1.0 a token) for the deltas, in order."""
    writer = OutputsWriter()
    for rid, ids, finish, verify in deltas:
        logprobs = pack_floats([-1.0] * len(ids))
        writer.add(
            0, rid, pack_ids(ids), verify, 0, logprobs, FinishReason(finish) if finish else None
        )
    [message] = writer.take()
    return message


def add(tracker: RequestTracker, rid: str):
    return tracker.add(rid, 3, detokenizer=Angles())


def test_deltas_accumulate_and_finish_removes_the_request():
    async def run():
        finished = []
        tracker = RequestTracker(on_finish=finished.append)
        a, b = add(tracker, "a"), add(tracker, "b")
        tracker.feed(step(delta("a", [1, 2]), delta("b", [9])))
        tracker.feed(step(delta("a", [3], "length", spec_verify_ct=2)))
        chunks = [c async for c in a.chunks()]
        assert tracker.num_in_flight == 1 and "a" not in tracker and "b" in tracker
        assert finished == [a]
        return a, b, chunks

    a, b, chunks = asyncio.run(run())
    # both deltas were pending when the consumer looked: one coalesced chunk
    assert len(chunks) == 1 and chunks[0].output_ids == [1, 2, 3]
    assert chunks[0].finish == FinishReason("length") and chunks[0].ids_end == 3
    assert a.text == "<1><2><3>" and a.output_ids == [1, 2, 3] and a.logprobs == [-1.0] * 3
    assert a.completion_tokens == 3 and a.spec_verify_ct == 2 and a.prompt_tokens == 3
    assert b.output_ids == [9] and not b.finished


def test_consumer_sees_each_delta_when_it_keeps_up():
    async def run():
        tracker = RequestTracker()
        state = add(tracker, "r")
        seen = []

        async def consume():
            async for chunk in state.chunks():
                seen.append((chunk.output_ids, chunk.text_end, chunk.finish))

        task = asyncio.create_task(consume())
        for ids, finish in (([1], None), ([2, 3], None), ([4], "stop")):
            await asyncio.sleep(0)
            tracker.feed(step(delta("r", ids, finish)))
        await task
        return seen

    seen = asyncio.run(run())
    assert [s[0] for s in seen] == [[1], [2, 3], [4]]
    assert [s[1] for s in seen] == [3, 9, 12]
    assert [s[2] for s in seen] == [None, None, FinishReason("stop")]


def test_a_chunk_carries_everything_since_the_consumer_last_looked():
    """The consumer looks at random moments: each chunk holds exactly the deltas fed since
    its last look, in order, and snapshots the request after the last of them."""
    rng = random.Random(0)

    async def run():
        tracker = RequestTracker()
        state = add(tracker, "r")
        chunks, since, looks = state.chunks(), [], 0
        for k in range(300):
            last = k == 299
            ids = [k, k + 1000][: 1 + k % 2]
            tracker.feed(step(delta("r", ids, "stop" if last else None, spec_verify_ct=k // 3)))
            since += [k, k + 1000][: 1 + k % 2]
            if last or rng.random() < 0.3:
                chunk = await anext(chunks)
                looks += 1
                assert chunk.output_ids == since and chunk.logprobs == [-1.0] * len(since)
                assert chunk.text == "".join(f"<{i}>" for i in since)
                assert (chunk.text_end, chunk.ids_end) == (len(state.text), len(state.output_ids))
                assert (chunk.completion_tokens, chunk.spec_verify_ct) == (
                    len(state.output_ids),
                    k // 3,
                )
                assert (chunk.finish is not None) == last
                since = []
        assert 50 < looks < 150
        assert [c async for c in chunks] == []  # the finishing chunk was the last

    asyncio.run(run())


def test_unknown_rids_are_ignored_and_abort_finishes_locally():
    async def run():
        tracker = RequestTracker()
        tracker.feed(step(delta("ghost", [1], "stop")))
        state = add(tracker, "r")
        assert not await tracker.wait_idle(0.01)
        assert tracker.abort("r") and not tracker.abort("r")
        assert await tracker.wait_idle(1.0)
        tracker.feed(step(delta("r", [5], "stop")))  # late outputs after abort
        chunks = [c async for c in state.chunks()]
        return state, chunks

    state, chunks = asyncio.run(run())
    assert state.finish.type == "abort" and state.output_ids == []
    assert [c.finish.type for c in chunks] == ["abort"]


def test_duplicate_rid_is_refused():
    tracker = RequestTracker()
    tracker.add("r")
    try:
        tracker.add("r")
    except ValueError as e:
        assert "r" in str(e)
    else:
        raise AssertionError("duplicate rid accepted")
