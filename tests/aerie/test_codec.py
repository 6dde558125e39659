from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from aerie import codec
from aerie.messages import (
    MESSAGE_TYPES,
    FinishReason,
    ForwardPlan,
    RequestStart,
    SamplingParams,
    StepResult,
)


def test_nested_message_round_trips():
    start = RequestStart(3, SamplingParams(stop=["\n\n"], seed=7), True, codec.pack_ids([5, 6]), 1)
    plan = ForwardPlan(
        plan_id=9,
        mode="extend",
        rows=codec.pack_ids([3]),
        input_ids=codec.pack_ids([1, 2]),
        starts=[start],
    )
    decoded = codec.decode(codec.encode(plan))
    assert decoded == plan
    assert codec.unpack_ids(decoded.input_ids) == [1, 2]
    assert decoded.starts[0].sampling.stop == ["\n\n"] and decoded.starts[0].row == 3


def test_every_registered_type_round_trips_with_defaults():
    for cls in MESSAGE_TYPES:
        required = {
            f.name: _sample_value(f.type)
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        message = cls(**required)
        assert codec.decode(codec.encode(message)) == message


def _sample_value(type_name: str):
    samples = {"str": "x", "int": 1, "bytes": b"\x01\x00\x00\x00", "float": 0.5, "bool": True}
    if type_name in samples:
        return samples[type_name]
    if type_name.startswith("list["):
        return []
    if type_name.startswith("dict["):
        return {"k": 1}
    if type_name == "SamplingParams":
        return SamplingParams()
    raise AssertionError(f"add a sample for {type_name}")


def test_token_arrays_are_little_endian_int32():
    assert codec.pack_ids([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    result = StepResult(plan_id=1, num_tokens=codec.pack_ids([2]), token_ids=codec.pack_ids([7, 8]))
    assert codec.unpack_ids(codec.decode(codec.encode(result)).token_ids) == [7, 8]
    assert codec.unpack_floats(codec.pack_floats([0.5, -1.0])) == [0.5, -1.0]


@pytest.mark.parametrize("length", [0, 1, 3, 64, 65, 1000])
def test_short_and_long_arrays_unpack_as_numpy_reads_them(length):
    """Short arrays take the memoryview path, long ones numpy's: the same values either way,
    negative ids and float specials included, and a cut buffer is refused the same way."""
    ids = [(-1) ** k * (k * 7919 % 2**31) for k in range(length)]
    floats = [float("nan"), float("-inf"), -0.1, 1e-45, 3.4e38][:length] + [-0.5] * (length - 5)
    packed_ids, packed_floats = codec.pack_ids(ids), codec.pack_floats(floats)
    assert codec.unpack_ids(packed_ids) == np.frombuffer(packed_ids, dtype="<i4").tolist() == ids
    as_numpy = np.frombuffer(packed_floats, dtype="<f4").tolist()
    assert np.array_equal(codec.unpack_floats(packed_floats), as_numpy, equal_nan=True)
    if length:
        with pytest.raises(ValueError):
            codec.unpack_ids(packed_ids[:-1])
        with pytest.raises(ValueError):
            codec.unpack_floats(packed_floats[:-1])


def test_unregistered_objects_are_refused():
    with pytest.raises(codec.CodecError):
        codec.encode({"type": "ForwardPlan"})

    @dataclasses.dataclass(frozen=True)
    class FinishReason2:  # same shape, not registered
        type: str

    with pytest.raises(codec.CodecError):
        codec.encode(FinishReason2("stop"))


def test_unknown_type_tag_and_garbage_are_loud():
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["Evil", 1])))
    with pytest.raises(codec.CodecError, match="unknown message type"):
        codec.decode(forged)
    with pytest.raises(codec.CodecError):
        codec.decode(b"\xc1garbage")
    with pytest.raises(codec.CodecError, match="not a message"):
        codec.decode(msgpack.packb([1, 2]))


def test_field_count_mismatch_is_loud():
    forged = msgpack.packb(msgpack.ExtType(1, msgpack.packb(["FinishReason", "stop"])))
    with pytest.raises(codec.CodecError, match="expected 3 fields"):
        codec.decode(forged)
    assert codec.decode(codec.encode(FinishReason("stop", 2))).matched == 2


def test_registry_rejects_mutable_and_duplicate_types():
    @dataclasses.dataclass
    class Mutable:
        x: int

    with pytest.raises(TypeError, match="frozen"):
        codec._build_registry([Mutable])
    with pytest.raises(TypeError, match="duplicate"):
        codec._build_registry([FinishReason, FinishReason])
