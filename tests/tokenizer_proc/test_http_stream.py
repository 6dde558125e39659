"""Streamed events written straight to the connection (`DirectBody`, `EventStream`): the bytes
h11 would write, every case uvicorn's send must handle left to it, and live streams."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from types import SimpleNamespace

import h11
import httpx
import pytest

from tests.tokenizer_proc.harness import LiveServer, make_frontend, wait_until
from tokenizer_proc.http_stream import DirectBody, EventStream

PIECES = [b"data: {}\n\n", b"x", b"data: " + "é🙂".encode() * 40 + b"\n\n", b"\r\n0\r\n\r\n"]


def server_connection(http_version: str = "1.1", method: str = "POST") -> h11.Connection:
    """An h11 server connection that has sent the head of a response without a length."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(f"{method} /s HTTP/{http_version}\r\nHost: x\r\n\r\n".encode())
    assert isinstance(conn.next_event(), h11.Request)
    conn.send(h11.Response(status_code=200, headers=[(b"content-type", b"text/event-stream")]))
    return conn


def fake_cycle(conn: h11.Connection, method: str = "POST", **flags) -> SimpleNamespace:
    """The parts of uvicorn's RequestResponseCycle that DirectBody reads."""
    written: list[bytes] = []
    state = {"response_started": True, "response_complete": False, "disconnected": False}
    state.update(flags)
    return SimpleNamespace(
        scope={"method": method},
        conn=conn,
        written=written,
        transport=SimpleNamespace(write=written.append),
        flow=SimpleNamespace(write_paused=False),
        **state,
    )


def client_body(raw: bytes) -> bytes:
    """The body an h11 client reads from a response's raw bytes, up to the connection's end."""
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="POST", target="/s", headers=[("Host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(raw)
    client.receive_data(b"")
    body = b""
    while not isinstance(event := client.next_event(), h11.EndOfMessage):
        assert event is not h11.NEED_DATA, "the response did not end"
        if isinstance(event, h11.Data):
            body += event.data
    return body


@pytest.mark.parametrize("http_version", ["1.1", "1.0"])
def test_direct_pieces_are_the_bytes_h11_writes(http_version):
    """Chunked (HTTP/1.1): framed by the writer after the first piece; close-delimited
    (HTTP/1.0): every piece through h11. Either way the bytes equal h11's own."""
    cycle, reference = fake_cycle(server_connection(http_version)), server_connection(http_version)
    direct = DirectBody(cycle)  # type: ignore[arg-type]
    for piece in PIECES:
        assert direct.write(piece)
    assert direct.chunked is (http_version == "1.1")
    expected = [reference.send(h11.Data(data=piece)) for piece in PIECES]
    assert cycle.written == expected
    end = cycle.conn.send(h11.EndOfMessage()) or b""
    head = b"HTTP/1.1 200 OK\r\n" + (b"transfer-encoding: chunked\r\n" if direct.chunked else b"")
    assert client_body(head + b"\r\n" + b"".join(cycle.written) + end) == b"".join(PIECES)


@pytest.mark.parametrize(
    "flags",
    [
        {"response_started": False},
        {"response_complete": True},
        {"disconnected": True},
        {"write_paused": True},
        {"method": "HEAD"},
        {"empty": True},
    ],
)
def test_direct_body_leaves_to_send_what_send_must_handle(flags):
    cycle = fake_cycle(server_connection(), method=flags.pop("method", "POST"))
    cycle.flow.write_paused = flags.pop("write_paused", False)
    empty = flags.pop("empty", False)
    for name, value in flags.items():
        setattr(cycle, name, value)
    direct = DirectBody(cycle)  # type: ignore[arg-type]
    assert not direct.write(b"" if empty else b"data: x\n\n")
    assert cycle.written == [] and direct.chunked is None


def test_event_stream_sends_what_the_direct_path_declines_in_order():
    log: list = []

    class Direct:
        def write(self, data: bytes) -> bool:
            if data.startswith(b"direct"):
                log.append(("direct", data))
                return True
            return False

    async def send(message: dict) -> None:
        log.append((message["type"], message.get("body"), message.get("more_body")))

    async def events():
        for event in (b"direct 1", b"send 2", b"direct 3", b"send 4"):
            yield event

    response = EventStream(events())
    response.direct = Direct()  # type: ignore[assignment]
    asyncio.run(response.stream_response(send))
    assert log == [
        ("http.response.start", None, None),
        ("direct", b"direct 1"),
        ("http.response.body", b"send 2", True),
        ("direct", b"direct 3"),
        ("http.response.body", b"send 4", True),
        ("http.response.body", b"", False),
    ]


def test_live_streams_go_through_the_direct_path(live, monkeypatch):
    """Every event of every stream, one request after another on a kept-alive connection (each
    request gets its own DirectBody)."""
    server, _, _ = live
    written = []
    write = DirectBody.write

    def counting_write(self, data):
        ok = write(self, data)
        written.append(ok)
        return ok

    monkeypatch.setattr(DirectBody, "write", counting_write)
    bodies = {
        "/v1/completions": {"prompt": "Hello", "max_tokens": 6, "stream": True, "logprobs": 1},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stream": True,
        },
        "/generate": {"input_ids": [5], "stream": True, "sampling_params": {"max_new_tokens": 4}},
    }
    with httpx.Client() as client:
        for path, body in bodies.items():
            written.clear()
            with client.stream("POST", server.url + path, json=body) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])
            assert len(written) == len(events) and all(written), path
        assert client.get(server.url + "/health").status_code == 200  # the connection is fine


def test_an_http_1_0_client_gets_a_close_delimited_stream(live):
    server, _, _ = live
    body = json.dumps({"input_ids": [5], "stream": True, "sampling_params": {"max_new_tokens": 4}})
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            f"POST /generate HTTP/1.0\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}".encode()
        )
        raw = b""
        while chunk := sock.recv(65536):  # the server closes the connection at the end
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding" not in head.lower()
    events = [e.removeprefix(b"data: ") for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    assert json.loads(events[-2])["meta_info"]["completion_tokens"] == 4


class BigText:
    """A detokenizer whose every step is half a MiB of text: a few steps fill any socket's
    send buffers."""

    def step(self, ids: list[int], finish=None) -> str:
        return "x" * (512 << 10)


@pytest.fixture
def big_streams(tokenizer_dir):
    """(LiveServer, FakeEngine): completions of 30 steps 0.1 s apart, each step's text half a
    MiB, behind a 0.3 s slow-client cut-off."""
    frontend, engine = make_frontend(tokenizer_dir)
    frontend.tokenizer.detokenizer = lambda sampling, stream, prompt_ids: BigText()
    engine.delay_s = 0.1
    with LiveServer(frontend, slow_client_timeout_s=0.3) as server:
        yield server, engine


BIG_REQUEST = {"prompt": "Hello", "max_tokens": 60, "stream": True}


def silent_client(server, body: dict, headers: str = "") -> socket.socket:
    """A connection that sent a completions request (extra header lines: headers) and will
    read nothing until told: a 4 KiB receive buffer, so the server's buffers fill soon."""
    data = json.dumps(body)
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(15)
    sock.connect((host, int(port)))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"{headers}Content-Length: {len(data)}\r\n\r\n{data}".encode()
    )
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """What the buffers hold, up to the connection's end (a reset counts as its end)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while piece := sock.recv(1 << 20):
            received += piece
    return received


def test_a_client_that_reads_nothing_is_cut_off_and_its_request_aborted(big_streams, caplog):
    server, engine = big_streams
    with silent_client(server, BIG_REQUEST) as sock:
        # The request runs 3 s; the client is cut off once its buffers fill (under 1 s).
        assert wait_until(lambda: engine.aborted, timeout_s=2.5)
        assert engine.aborted == [engine.submitted[0].rid]
        received = read_to_end(sock)
    assert received.startswith(b"HTTP/1.1 200") and b"[DONE]" not in received
    (line,) = [r.getMessage() for r in caplog.records if "cut off" in r.getMessage()]
    assert "/v1/completions: it read nothing for 0.3 s" in line


def test_a_client_that_reads_is_not_cut_off(big_streams):
    """The send buffer fills and drains many times while this client reads the 15 MiB."""
    server, engine = big_streams
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", server.url + "/v1/completions", json=BIG_REQUEST) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert events[-1] == "data: [DONE]" and len(text) == 30 * (512 << 10)
    assert engine.aborted == []


def test_a_closing_connection_whose_client_reads_nothing_is_cut_off_too(big_streams, caplog):
    """`Connection: close` after a whole (not streamed) 15 MiB response: closing waits for the
    client to read what is buffered, so the cut-off must end it all the same."""
    server, _ = big_streams
    whole = {**BIG_REQUEST, "stream": False}
    with silent_client(server, whole, "Connection: close\r\n") as sock:
        assert wait_until(lambda: any("cut off" in r.getMessage() for r in caplog.records), 10)
        received = read_to_end(sock)
    assert received.startswith(b"HTTP/1.1 200") and len(received) < 30 * (512 << 10)
