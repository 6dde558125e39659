"""Malformed ZMQ client traffic for fuzz tests: random and structured frames, seeded.

`fuzz_frames(rng, n)` yields lists of frames (what one DEALER `send_multipart` sends): random
bytes, truncated and oversized payloads, msgpack values of every type (ext types, timestamps,
non-string keys, NaN and 64-bit edge integers, deep nesting up to msgpack's own limit), and
well-formed envelopes or /generate bodies with one field replaced by such a value.
`send_good_request` checks that a well-formed client is still served.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from typing import Any

import msgpack
import zmq

GOOD_BODY = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}
BODY_FIELDS = ("text", "input_ids", "sampling_params", "stream", "return_logprob", "rid")
SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
EDGE_INTS = (0, -1, 1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), 2**64 - 1, 10**6)
EDGE_FLOATS = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1e308, 5e-324)


def random_text(rng: random.Random, max_len: int = 40) -> str:
    alphabet = string.printable + "\u00e9\u4e2d\U0001f600\x00"
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def nested(rng: random.Random, depth: int) -> Any:
    """A list or map chain `depth` levels deep."""
    value: Any = rng.choice([1, "x", None])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def random_value(rng: random.Random, depth: int = 0) -> Any:
    """Any msgpack-encodable value (small, but of every type and some edge values)."""
    kind = rng.randrange(13 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(EDGE_INTS)
    if kind == 3:
        return rng.choice(EDGE_FLOATS)
    if kind == 4:
        return random_text(rng)
    if kind == 5:
        return rng.randbytes(rng.randint(0, 40))
    if kind == 6:
        return msgpack.ExtType(rng.randint(0, 127), rng.randbytes(rng.randint(0, 8)))
    if kind == 7:
        return msgpack.Timestamp(rng.randint(0, 2**32 - 1))
    if kind == 8:
        return "x" * rng.choice((257, 5000, 100_000))
    if kind == 9:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == 10:
        return {random_text(rng, 8): random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}
    if kind == 11:
        return {rng.choice(EDGE_INTS): random_value(rng, depth + 1)}  # non-string key
    return nested(rng, rng.choice((9, 50, 1000)))


def pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def structured(rng: random.Random) -> dict:
    """A well-formed generate envelope with one field (or body / sampling field) replaced."""
    body = {**GOOD_BODY, "sampling_params": dict(GOOD_BODY["sampling_params"])}
    envelope: dict[Any, Any] = {"op": "generate", "req_id": rng.randint(0, 10**6), "body": body}
    where = rng.randrange(4)
    if where == 0:
        envelope[rng.choice(("op", "req_id", "body"))] = random_value(rng)
    elif where == 1:
        body[rng.choice(BODY_FIELDS)] = random_value(rng)
    elif where == 2:
        body["sampling_params"][rng.choice(SAMPLING_FIELDS)] = random_value(rng)
    else:
        envelope[random_value(rng)] = random_value(rng)  # extra field, maybe not a string key
    return envelope


def fuzz_frames(rng: random.Random, n: int) -> Iterator[list[bytes]]:
    good = pack({"op": "generate", "req_id": 1, "body": GOOD_BODY})
    for _ in range(n):
        kind = rng.randrange(8)
        if kind == 0:
            yield [rng.randbytes(rng.randint(0, 200))]
        elif kind == 1:
            yield [good[: rng.randint(0, len(good) - 1)]]  # truncated
        elif kind == 2:
            yield [pack(random_value(rng))]
        elif kind == 3:  # the op field of an abort replaced, or an abort with a body
            yield [pack({"op": "abort", "req_id": random_value(rng), "body": random_value(rng)})]
        elif kind == 4:
            yield [pack(rng.choice((good, random_value(rng)))) for _ in range(rng.randint(2, 3))]
        elif kind == 5:
            yield [b""]
        elif kind == 6:
            try:
                yield [pack(structured(rng))]
            except (TypeError, ValueError, OverflowError):  # unhashable or unpackable key
                yield [pack(random_value(rng))]
        else:
            yield [pack({"op": "generate", "req_id": 2, "body": nested(rng, 1000)})]


def send_good_request(sock: zmq.Socket, req_id: int | str, timeout_s: float = 30.0) -> dict:
    """Send GOOD_BODY on sock and return its "done" data (skipping pings and other replies)."""
    sock.send(pack({"op": "generate", "req_id": req_id, "body": GOOD_BODY}))
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if not poller.poll(timeout_s * 1000):
            raise AssertionError(f"no answer to a well-formed request within {timeout_s} s")
        reply = msgpack.unpackb(sock.recv(), raw=False, strict_map_key=False)
        if reply.get("req_id") == req_id and reply.get("event") in ("done", "error"):
            assert reply["event"] == "done", reply
            return reply["data"]
