"""Fuzzing the ZMQ frontend: no frame of any shape, size or nesting stops it from serving."""

from __future__ import annotations

import random

import msgpack
import pytest

from tests.tokenizer_proc.harness import dealer, wait_until
from tests.tokenizer_proc.zmq_fuzz import fuzz_frames, pack, send_good_request


@pytest.mark.parametrize("seed", [0, 1])
def test_malformed_frames_never_stop_the_frontend(live, seed):
    server, frontend, engine = live
    rng = random.Random(seed)
    fuzzer, bystander = dealer(server.zmq_address), dealer(server.zmq_address)
    for i, frames in enumerate(fuzz_frames(rng, 1500)):
        fuzzer.send_multipart(frames)
        if i % 300 == 299:  # everyone is still served while the storm goes on
            send_good_request(bystander, f"good-{i}")
    assert not server.zmq_task.done()
    send_good_request(fuzzer, "after the storm")  # the fuzzing connection itself, too
    assert wait_until(lambda: frontend.tracker.num_in_flight == 0)
    fuzzer.close()
    bystander.close()


def test_each_malformed_message_gets_one_error_reply(live):
    server, _, engine = live
    sock = dealer(server.zmq_address)
    cases = [
        (b"\xc1", None),  # not msgpack
        (pack([1, 2]), None),  # not a map
        (pack({"op": "generate", "req_id": [1], "body": {}}), None),  # req_id a list
        (pack({"op": "generate", "req_id": {"a": 1}, "body": {}}), None),  # req_id a map
        (pack({"op": ["generate"], "req_id": 3}), 3),  # op a list
        (pack({"op": {"x": 1}, "req_id": 4}), 4),  # op a map
        (pack({"op": "generate", "req_id": "x" * 257, "body": {}}), None),  # req_id too long
        (pack({"op": "generate", "req_id": 5, "body": [1]}), 5),  # body not a map
        (pack({"op": "generate", "req_id": 6, "body": {"x": [[[[[[[[[1]]]]]]]]]}}), 6),
        (pack({"op": "generate", "req_id": 7, "body": {"t": msgpack.ExtType(1, b"")}}), 7),
        (pack({"op": "abort", "req_id": 8, "body": {}}), 8),  # abort takes no body
        (pack({"op": "generate", "req_id": 9, "body": {}, "extra": 1}), 9),
    ]
    for payload, req_id in cases:
        sock.send(payload)
        reply = msgpack.unpackb(sock.recv(), raw=False)
        assert reply["event"] == "error" and reply["req_id"] == req_id, (payload[:40], reply)
        assert reply["data"]["code"] == 400 and reply["data"]["message"]
    sock.send_multipart([pack({"op": "abort", "req_id": 1}), b"second frame"])
    reply = msgpack.unpackb(sock.recv(), raw=False)
    assert reply["event"] == "error" and "one frame" in reply["data"]["message"]
    assert engine.submitted == []
    sock.close()
