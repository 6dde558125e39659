"""A launched server under hostile and careless clients: malformed ZMQ traffic, abort storms,
reused rids, a stop string arriving mid-stream, a burst into a small KV cache, and a process
that dies. Each test names the failure it guards against."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import signal
import socket
import threading
import time

import httpx
import pytest
import zmq

from aerie.process import process_alive
from tests.e2e.server import Server, assert_no_orphans, child_named
from tests.tokenizer_proc.zmq_fuzz import fuzz_frames, send_good_request

pytestmark = pytest.mark.e2e

LONG = {"max_new_tokens": 480, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with Server("--model-path", tiny_model_dirs["llama"], "--max-running-requests", "64") as s:
        yield s


def server_info(server: Server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()


def wait_idle(server: Server, timeout_s: float) -> dict:
    """/server_info once nothing runs or waits and the KV is free; fails after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server_info(server)
        idle = (info["num_running"], info["num_waiting"], info["kv_used_tokens"]) == (0, 0, 0)
        if idle:
            return info
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {info}"
        time.sleep(0.05)


def test_malformed_zmq_traffic_never_stops_the_server(server):
    """One list-valued req_id used to end the ZMQ frontend and with it the whole server."""
    context = zmq.Context.instance()
    fuzzer, client = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
    for sock in (fuzzer, client):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.zmq_address)
    for i, frames in enumerate(fuzz_frames(random.Random(7), 600)):
        fuzzer.send_multipart(frames)
        if i % 200 == 199:
            assert send_good_request(client, i)["meta_info"]["finish_reason"]
    assert send_good_request(fuzzer, "after")["output_ids"]
    assert server.proc.poll() is None
    assert httpx.get(server.url + "/health").status_code == 200
    fuzzer.close()
    client.close()
    wait_idle(server, 30)


def test_every_abort_of_an_abort_storm_is_applied(server):
    """96 streams left after their first delta, four times over: every request is aborted at
    once (they would run 480 tokens each otherwise) and the KV is free again. Sends through a
    blocking shadow of the frontend's socket used to swallow the readiness edge, so aborts sat
    unread and abandoned requests ran to the end."""
    from aerie.client import AsyncClient

    async def storm() -> None:
        client = AsyncClient(server.zmq_address)

        async def leave_early(i: int) -> None:
            async for _ in client.stream(input_ids=[5, 1 + i % 300], sampling_params=LONG):
                break

        await asyncio.gather(*(leave_early(i) for i in range(96)))
        await asyncio.sleep(0.05)  # the closed streams' aborts go out
        client.close()

    for _ in range(4):
        asyncio.run(storm())
        wait_idle(server, timeout_s=3.0)


@pytest.mark.parametrize("transport", ["http", "zmq"])
def test_a_rid_reused_right_after_its_abort_gets_its_own_output(server, transport):
    """The newcomer used to be dropped by the scheduler as a duplicate and receive the old
    request's abort."""
    from aerie.client import Client

    short = {"max_new_tokens": 8, "temperature": 0}
    expected = httpx.post(
        server.url + "/generate",
        timeout=60,
        json={"input_ids": [9, 8, 7], "sampling_params": short},
    ).json()["output_ids"]
    for attempt in range(5):
        rid = f"reused-{transport}-{attempt}"
        if transport == "http":
            body = {"input_ids": [5, 6], "sampling_params": LONG, "stream": True, "rid": rid}
            with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
                lines = r.iter_lines()
                next(lines)  # running; leaving the block disconnects, which aborts it
            again = httpx.post(
                server.url + "/generate",
                timeout=60,
                json={"input_ids": [9, 8, 7], "sampling_params": short, "rid": rid},
            ).json()
        else:
            with Client(server.zmq_address) as client:
                for _ in client.stream(input_ids=[5, 6], sampling_params=LONG, rid=rid):
                    break  # leaving the stream aborts it
                again = client.generate(input_ids=[9, 8, 7], sampling_params=short, rid=rid)
        assert again["meta_info"]["id"] == rid
        assert again["meta_info"]["finish_reason"]["type"] == "length"
        assert again["output_ids"] == expected
    wait_idle(server, 30)


def test_bad_input_on_the_real_tokenizer_is_a_400(server):
    """A lone surrogate used to reach the tokenizer (500, connection reset); a seed beyond 64
    bits the msgpack codec (500); top_p or repetition_penalty 1e-50 the worker, where float32
    made it 0: NaN logprobs, a 500 (not JSON compliant)."""
    for body in (
        b'{"text": "a\\ud800"}',
        b'{"text": "a", "sampling_params": {"seed": 18446744073709551616}}',
        b'{"text": "a", "sampling_params": {"temperature": 1e999}}',
        b'{"text": "a", "return_logprob": true, "sampling_params": {"top_p": 1e-50}}',
        b'{"text": "a", "return_logprob": true, "sampling_params": {"repetition_penalty": 1e-50}}',
    ):
        r = httpx.post(
            server.url + "/generate",
            content=body,
            timeout=30,
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_stop_string_request_does_not_stall_a_running_stream(server):
    """The scheduler used to load a tokenizer inside its loop on the first request with a stop
    string: seconds without progress for every stream."""
    body = {"input_ids": [5, 6, 7], "sampling_params": LONG, "stream": True}
    times: list[float] = []
    sent_at: list[float] = []

    def stop_string_request() -> None:
        sent_at.append(time.monotonic())
        httpx.post(
            server.url + "/generate",
            timeout=60,
            json={"text": "hello", "sampling_params": {"max_new_tokens": 16, "stop": ["zz"]}},
        )

    with httpx.stream("POST", server.url + "/generate", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
                if len(times) == 20:
                    threading.Thread(target=stop_string_request).start()
    after = [t for t in times if t >= sent_at[0]]
    gaps = [b - a for a, b in zip(after, after[1:], strict=False)]
    assert len(times) == LONG["max_new_tokens"] or len(times) > 100
    assert max(gaps) < 1.5, f"a stream stalled for {max(gaps):.2f} s"


def test_health_is_503_as_soon_as_a_child_is_gone(tiny_model_dirs):
    """/health used to answer 200 for seconds after a child died."""
    with Server("--model-path", tiny_model_dirs["llama"]) as server:
        victim = child_named(server, "scheduler")
        os.kill(victim, signal.SIGKILL)
        while process_alive(victim):
            time.sleep(0.001)
        try:
            status = httpx.get(server.url + "/health", timeout=5).status_code
        except httpx.HTTPError:
            status = None  # already shut down: not healthy either
        assert status != 200
        assert server.proc.wait(timeout=10) != 0
        assert_no_orphans(server)


def test_a_burst_into_a_small_kv_cache_is_not_slower_than_serial(tiny_model_dirs):
    """32 concurrent greedy requests at --max-total-tokens 256 used to retract and recompute
    over and over (44 retractions here; slower than one at a time on a model whose steps
    cost compute)."""
    rng = random.Random(3)
    bodies = [
        {
            "input_ids": [rng.randrange(3, 320) for _ in range(rng.randint(8, 24))],
            "sampling_params": {
                "max_new_tokens": rng.randint(20, 60),
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for _ in range(32)
    ]
    args = ("--model-path", tiny_model_dirs["llama"], "--max-total-tokens", "256")
    with Server(*args) as server, httpx.Client(timeout=120) as http:
        http.post(server.url + "/generate", json=bodies[0])  # warm up
        start = time.monotonic()
        serial = [http.post(server.url + "/generate", json=b).json() for b in bodies]
        serial_s = time.monotonic() - start
        start = time.monotonic()
        with httpx.Client(timeout=120, limits=httpx.Limits(max_connections=64)) as pool:
            threads, burst = [], [None] * len(bodies)

            def send(i: int) -> None:
                burst[i] = pool.post(server.url + "/generate", json=bodies[i]).json()

            for i in range(len(bodies)):
                threads.append(threading.Thread(target=send, args=(i,)))
                threads[-1].start()
            for t in threads:
                t.join()
        burst_s = time.monotonic() - start
        info = wait_idle(server, 30)
    assert [b["output_ids"] for b in burst] == [s["output_ids"] for s in serial]
    print(f"serial {serial_s:.2f} s, burst {burst_s:.2f} s, {info['num_retractions']} retractions")
    assert info["num_retractions"] <= 2
    assert burst_s <= serial_s


def test_a_killed_launcher_leaves_no_runtime_directory(tiny_model_dirs, tmp_path):
    """SIGKILL of the launcher used to leave its directory of IPC sockets behind. Also: with
    --host 0.0.0.0 the ready line names the address actually bound (it said 127.0.0.1)."""
    args = ("--model-path", tiny_model_dirs["llama"], "--host", "0.0.0.0", "--api-key", "k")
    with Server(*args, env={"TMPDIR": str(tmp_path)}) as server:
        assert server.zmq_address.startswith("tcp://0.0.0.0:")
        assert server.url.startswith("http://0.0.0.0:")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("aerie-")]
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(timeout=10)
        assert_no_orphans(server)
        deadline = time.monotonic() + 10
        while [p for p in tmp_path.iterdir() if p.name.startswith("aerie-")]:
            assert time.monotonic() < deadline, list(tmp_path.iterdir())
            time.sleep(0.05)


def raw_get_json(sock: socket.socket, path: str) -> dict:
    """GET path on an open keep-alive connection; the JSON body."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return json.loads(body)


def test_the_connection_cap_and_the_drain_timeout_answer_in_json(tiny_model_dirs):
    """--max-connections 3 serves three connections and refuses the fourth with a JSON 503
    (uvicorn's limit refused the third, in text/plain). Requests still running when the drain
    times out get a JSON 503 (a stream: a final error event), not a 200 "aborted by the
    client" or a text/plain 500. One frontend: with several, each serves its share of the cap
    and the kernel decides where a connection goes."""
    body = {"input_ids": [5, 6], "sampling_params": LONG}
    args = (
        "--model-path",
        tiny_model_dirs["llama"],
        "--max-connections",
        "3",
        "--drain-timeout-s",
        "0",
        "--tokenizer-worker-num",
        "1",
    )
    with Server(*args) as server:
        host, port = server.url.removeprefix("http://").split(":")
        probe = socket.create_connection((host, int(port)), timeout=30)  # the first of three
        results: list[httpx.Response] = []
        plain = threading.Thread(
            target=lambda: results.append(
                httpx.post(server.url + "/generate", json=body, timeout=120)
            )
        )
        streamed = {**body, "stream": True}
        with httpx.stream("POST", server.url + "/generate", json=streamed, timeout=120) as stream:
            lines = (line for line in stream.iter_lines() if line)
            assert json.loads(next(lines).removeprefix("data: "))["output_ids"]
            plain.start()  # the third connection
            deadline = time.monotonic() + 60
            while raw_get_json(probe, "/server_info")["num_running"] < 2:
                assert time.monotonic() < deadline, "the second request never ran"
                time.sleep(0.05)
            refused = httpx.get(server.url + "/health", timeout=30)  # the fourth
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "--max-connections" in refused.json()["error"]["message"]
            server.proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        plain.join(60)
        probe.close()
        assert server.proc.wait(timeout=60) == 0
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2].removeprefix("data: "))["error"]["code"] == 503
    assert results[0].status_code == 503
    assert "shutting down" in results[0].json()["error"]["message"]
