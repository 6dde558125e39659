from __future__ import annotations

from aerie.codec import pack_floats, pack_ids
from aerie.messages import DetokenizeStart, FinishReason, RequestDelta, TokenDeltas
from detokenizer_proc.incremental import Detokenizer

START = DetokenizeStart(skip_special_tokens=True, stop=[], stream=True, prompt_tail_ids=b"")


def delta(rid, ids, start=None, finish=None, **kwargs) -> RequestDelta:
    return RequestDelta(rid=rid, token_ids=pack_ids(ids), start=start, finish=finish, **kwargs)


def test_interleaved_requests_keep_separate_text_and_drop_state_at_finish(tokenizer):
    a = tokenizer.encode("héllo 世界 🙂")
    b = tokenizer.encode("The quick brown fox")
    detok = Detokenizer(tokenizer)
    texts = {"a": "", "b": ""}
    steps = max(len(a), len(b))
    for i in range(steps):
        batch = []
        for rid, ids in (("a", a), ("b", b)):
            if i < len(ids):
                last = i == len(ids) - 1
                finish = FinishReason(type="length") if last else None
                batch.append(delta(rid, ids[i : i + 1], START if i == 0 else None, finish))
        for out in detok.handle(TokenDeltas(deltas=batch)).deltas:
            texts[out.rid] += out.text
    assert texts == {"a": "héllo 世界 🙂", "b": "The quick brown fox"}
    assert detok.num_requests == 0


def test_fields_pass_through(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("Hello world")
    finish = FinishReason(type="stop", matched=tokenizer.eos_token_id)
    sent = delta(
        "r",
        ids + [tokenizer.eos_token_id],
        START,
        finish,
        logprobs=pack_floats([-0.5] * (len(ids) + 1)),
        prompt_tokens=7,
        completion_tokens=len(ids) + 1,
        spec_verify_ct=2,
    )
    (out,) = detok.handle(TokenDeltas(deltas=[sent])).deltas
    assert out.text == "Hello world"
    assert (out.rid, out.token_ids, out.logprobs, out.finish) == (
        "r",
        sent.token_ids,
        sent.logprobs,
        finish,
    )
    assert (out.prompt_tokens, out.completion_tokens, out.spec_verify_ct) == (7, len(ids) + 1, 2)


def test_abort_passes_through_and_flushes_held_text(tokenizer):
    detok = Detokenizer(tokenizer)
    abort = FinishReason(type="abort", message="client went away")
    (out,) = detok.handle(TokenDeltas(deltas=[delta("never-ran", [], finish=abort)])).deltas
    assert (out.text, out.finish) == ("", abort)

    start = DetokenizeStart(True, ["Stop"], True, b"")
    ids = tokenizer.encode("Hi Sto")
    first = detok.handle(TokenDeltas(deltas=[delta("r", ids, start)])).deltas[0]
    last = detok.handle(TokenDeltas(deltas=[delta("r", [], finish=abort)])).deltas[0]
    assert (first.text, last.text, last.finish) == ("Hi ", "Sto", abort)
    assert detok.num_requests == 0


def test_repeated_start_continues_the_same_text(tokenizer):
    detok = Detokenizer(tokenizer)
    ids = tokenizer.encode("🚀")  # split over byte tokens: the first half is pending
    first = detok.handle(TokenDeltas(deltas=[delta("r", ids[:1], START)])).deltas[0]
    rest = detok.handle(TokenDeltas(deltas=[delta("r", ids[1:], START)])).deltas[0]
    assert (first.text, rest.text) == ("", "🚀")


def test_state_is_bounded_lru(tokenizer):
    detok = Detokenizer(tokenizer, max_requests=2)
    ids = tokenizer.encode("🚀")
    detok.handle(TokenDeltas(deltas=[delta("a", ids[:1], START), delta("b", ids[:1], START)]))
    detok.handle(TokenDeltas(deltas=[delta("a", ids[1:2])]))  # touch a: b is now the oldest
    detok.handle(TokenDeltas(deltas=[delta("c", ids[:1], START)]))
    assert list(detok.states) == ["a", "c"]
