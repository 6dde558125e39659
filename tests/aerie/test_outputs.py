"""The columnar StepOutputs: what the writer is given comes back from the reader, request by
request, after a trip through the codec."""

from __future__ import annotations

from aerie.codec import decode, encode, pack_floats, pack_ids
from aerie.messages import FinishReason
from aerie.outputs import OutputsWriter, read_outputs


def test_outputs_round_trip_per_frontend_with_logprobs_for_those_that_asked():
    writer = OutputsWriter()
    assert not writer and writer.take() == []
    stop = FinishReason("stop", matched=7)
    # frontend 1 first: messages still come in frontend order
    writer.add(1, "c", pack_ids([5]), spec_verify_ct=3, cached_tokens=16)
    writer.add(0, "a", pack_ids([1, 2]), 1, 0, pack_floats([-0.5, -0.25]))
    writer.add(0, "b", pack_ids([]), 0, 0, None, FinishReason("abort", message="gone"))
    writer.add(0, "d", pack_ids([3, 4, 7]), 2, 8, pack_floats([-1.0, -2.0, -3.0]), stop)
    messages = [decode(encode(m)) for m in writer.take()]
    assert not writer and writer.take() == []
    assert [m.frontend for m in messages] == [0, 1]
    assert messages[0].rids == ["a", "b", "d"] and messages[1].rids == ["c"]
    assert messages[1].logprobs == messages[1].return_logprob == b""  # nobody there asked
    got = {out.rid: out for m in messages for out in read_outputs(m)}
    assert got["a"].token_ids == [1, 2] and got["a"].logprobs == [-0.5, -0.25]
    assert (got["a"].spec_verify_ct, got["a"].cached_tokens, got["a"].finish) == (1, 0, None)
    assert got["b"].token_ids == [] and got["b"].logprobs == []
    assert got["b"].finish == FinishReason("abort", message="gone")
    assert got["d"].token_ids == [3, 4, 7] and got["d"].logprobs == [-1.0, -2.0, -3.0]
    assert (got["d"].spec_verify_ct, got["d"].cached_tokens, got["d"].finish) == (2, 8, stop)
    assert got["c"].token_ids == [5] and got["c"].logprobs == []
    assert (got["c"].spec_verify_ct, got["c"].cached_tokens) == (3, 16)


def test_all_zero_count_columns_are_sent_empty_and_read_as_zeros():
    writer = OutputsWriter()
    writer.add(0, "a", pack_ids([1, 2]))
    writer.add(0, "b", pack_ids([3]), spec_verify_ct=0, cached_tokens=4)
    (message,) = [decode(encode(m)) for m in writer.take()]
    assert message.spec_verify_ct == b"" and len(message.cached_tokens) == 8
    got = [(o.rid, o.token_ids, o.spec_verify_ct, o.cached_tokens) for o in read_outputs(message)]
    assert got == [("a", [1, 2], 0, 0), ("b", [3], 0, 4)]
