"""Parsing ZMQ client frames: the envelope is read without building the body."""

from __future__ import annotations

import msgpack
import pytest

from tokenizer_proc.client_messages import (
    ProtocolError,
    parse_client_message,
    read_body,
    read_envelope,
)


def pack(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def test_the_envelope_is_read_without_reading_the_body():
    body = {"input_ids": list(range(1000)), "text": "x" * 5000}
    payload = pack({"body": body, "api_key": "k", "op": "generate", "req_id": "r"})
    envelope = read_envelope(payload)
    assert (envelope.op, envelope.req_id, envelope.api_key) == ("generate", "r", "k")
    assert read_body(payload, envelope) == body
    # A body that is not plain data passes the envelope (it was never looked into) and is
    # refused, with the req_id, only when read.
    bad = pack({"op": "generate", "req_id": 3, "body": {"t": msgpack.ExtType(1, b"")}})
    with pytest.raises(ProtocolError) as error:
        read_body(bad, read_envelope(bad))
    assert (error.value.req_id, error.value.param) == (3, "body")


@pytest.mark.parametrize(
    ("envelope", "req_id", "param"),
    [
        ({"op": ["generate"], "req_id": 3}, 3, "op"),
        ({"op": "generate", "req_id": {"a": [1]}, "body": {}}, None, "req_id"),
        ({"op": "generate", "req_id": b"\x00", "body": {}}, None, "req_id"),
        ({"op": "generate", "req_id": 4, "body": {}, "api_key": b"key"}, 4, "api_key"),
        ({"op": "generate", "req_id": 5, "body": [1]}, 5, "body"),
        ({"op": "abort", "req_id": 6, "body": {}}, 6, "body"),
        ({"op": "generate", "req_id": 7, "body": {}, ("a", "b"): 1}, 7, "<list, map or bytes>"),
        ({"op": "generate", "req_id": 8, "body": {}, 1: 1}, 8, "1"),
    ],
)
def test_fields_of_the_wrong_type_are_refused_by_name(envelope, req_id, param):
    with pytest.raises(ProtocolError) as error:
        read_envelope(pack(envelope))
    assert (error.value.req_id, error.value.param) == (req_id, param), error.value.message


ABORT = pack({"op": "abort", "req_id": 1})


@pytest.mark.parametrize("payload", [b"", b"\xc1", ABORT[:-1], ABORT + b"\x01"])
def test_corrupt_frames_are_not_msgpack(payload):
    with pytest.raises(ProtocolError, match="not a msgpack message"):
        read_envelope(payload)


def test_a_frame_that_is_not_a_map_says_so():
    with pytest.raises(ProtocolError, match="must be a map"):
        read_envelope(pack([1, 2]))


def test_parse_client_message_reads_both():
    message = parse_client_message(pack({"op": "generate", "req_id": 1, "body": {"text": "hi"}}))
    assert (message.op, message.req_id, message.body, message.api_key) == (
        "generate",
        1,
        {"text": "hi"},
        None,
    )
    abort = parse_client_message(pack({"op": "abort", "req_id": 2}))
    assert (abort.op, abort.body) == ("abort", None)


def test_a_map_wider_than_the_envelope_is_refused_before_its_fields_are_read(monkeypatch):
    """700,000 extra pairs (8 MB) would otherwise be scanned into a dict and sorted on the
    event loop, a second of work per frame for a client that needs no key."""
    import tokenizer_proc.client_messages as client_messages

    scanned = []
    scan = client_messages._scan_value
    monkeypatch.setattr(client_messages, "_scan_value", lambda *a: scanned.append(1) or scan(*a))
    wide = {"op": "generate", "req_id": 1, **{f"k{i}": i for i in range(1000)}}
    with pytest.raises(ProtocolError, match="at most 4 fields"):
        read_envelope(msgpack.packb(wide))
    assert scanned == []
