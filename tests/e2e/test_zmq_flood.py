"""A launched server flooded over ZMQ by raw DEALER sockets (frames with no key, garbage, valid
generates whose replies are never read) while a well-behaved HTTP client and our ZMQ `Client`
keep getting answers. The flood used to stall the tokenizer's event loop: /health and /generate
stopped answering, the tokenizer grew by most of a GiB and the watchdog ended the server."""

from __future__ import annotations

import threading
import time

import httpx
import msgpack
import pytest
import zmq

from aerie.client import Client
from tests.e2e.server import Server, child_named

pytestmark = pytest.mark.e2e

KEY = "flood-key-5c1e"
ANSWER_S = 10.0  # each answer a well-behaved client waits for, on a loaded 2-core machine
MAX_RSS_GROWTH_MIB = 150
FLOOD_DEADLINE_S = 180.0  # the server takes the flood far faster; this only ends a hang
SHORT = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with Server("--model-path", tiny_model_dirs["llama"], env={"AERIE_API_KEY": KEY}) as s:
        yield s


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def pack(msg: object) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def no_key_frames() -> list[bytes]:
    """Generates without the key, and frames that are not msgpack at all."""
    body = {"input_ids": [5, 6], "sampling_params": SHORT}
    frames = [pack({"op": "generate", "req_id": i, "body": body}) for i in range(512)]
    return frames + [b"\xc1 not msgpack"] * 64


def unread_generate_frames() -> list[bytes]:
    """Valid keyed generates (distinct req_ids) from a client that never reads its replies."""
    body = {"input_ids": [7, 8], "sampling_params": SHORT}
    return [
        pack({"op": "generate", "req_id": i, "body": body, "api_key": KEY}) for i in range(4096)
    ]


class Flooder(threading.Thread):
    """A raw DEALER sending `count` frames (cycling through `frames`) as fast as the server
    takes them, reading nothing; its connection stays open until `stop` is set."""

    def __init__(self, address: str, frames: list[bytes], count: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.address, self.frames, self.count, self.stop = address, frames, count, stop
        self.sent = 0

    def run(self) -> None:
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        try:
            while self.sent < self.count and not self.stop.is_set():
                try:
                    sock.send(self.frames[self.sent % len(self.frames)], zmq.NOBLOCK)
                    self.sent += 1
                except zmq.Again:  # the server reads this connection no faster than it can
                    sock.poll(50, zmq.POLLOUT)
            self.stop.wait()
        finally:
            sock.close()


def probe(server: Server, client: Client, pid: int) -> float:
    """One round of a well-behaved client: /health, /generate and a ZMQ generate, each within
    ANSWER_S; returns the tokenizer's resident MiB."""
    headers = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/health", timeout=ANSWER_S).status_code == 200
    r = httpx.post(
        server.url + "/generate",
        headers=headers,
        timeout=ANSWER_S,
        json={"input_ids": [5, 6, 7], "sampling_params": SHORT},
    )
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
    out = client.generate(input_ids=[9, 8], sampling_params=SHORT, timeout=ANSWER_S)
    assert len(out["output_ids"]) == 2
    return rss_mib(pid)


def test_a_zmq_flood_costs_the_flooder_not_everyone_else(server):
    tokenizer = child_named(server, "tokenizer")
    stop = threading.Event()
    # The keyed flooder's requests are served (up to its connection's budget) and cost the
    # tokenizer real work each, so it sends fewer frames: the test stays short.
    flooders = [
        Flooder(server.zmq_address, no_key_frames(), 60_000, stop),
        Flooder(server.zmq_address, no_key_frames(), 60_000, stop),
        Flooder(server.zmq_address, unread_generate_frames(), 10_000, stop),
    ]
    with Client(server.zmq_address, api_key=KEY) as client:
        before = probe(server, client, tokenizer)
        peak = before
        for flooder in flooders:
            flooder.start()
        try:
            rounds, deadline = 0, time.monotonic() + FLOOD_DEADLINE_S
            while rounds < 3 or (
                any(f.sent < f.count for f in flooders) and time.monotonic() < deadline
            ):
                peak = max(peak, probe(server, client, tokenizer))
                rounds += 1
                assert server.proc.poll() is None, server.log_text()
        finally:
            stop.set()
            for flooder in flooders:
                flooder.join(10)
        assert sum(f.sent for f in flooders) == 130_000, "the server stopped taking frames"
        assert peak - before < MAX_RSS_GROWTH_MIB, (before, peak)
        probe(server, client, tokenizer)  # still served once the flooders are gone
    with open(server.log.name) as f:
        num_log_lines = sum(1 for _ in f)
    assert num_log_lines < 500, "a log line per refused frame makes logging a bottleneck"
    assert server.proc.poll() is None
