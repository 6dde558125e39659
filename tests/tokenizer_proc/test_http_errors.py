"""Every error is a JSON body in the API's error format, and the keep-alive connection that
carried the bad request keeps working (checked on one raw socket)."""

from __future__ import annotations

import json
import socket

import pytest

from tokenizer_proc.validation import MAX_BODY_DEPTH


class Connection:
    """One HTTP/1.1 keep-alive connection; `request` fails if the server closed it."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buffer = b""

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")  # fmt: skip
        self.sock.sendall(head.encode() + body)
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head_bytes, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head_bytes.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        assert "content-length" in headers, headers  # no chunked bodies in these tests
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._read()
        payload, self.buffer = self.buffer[:length], self.buffer[length:]
        assert headers.get("connection") != "close"
        return int(status_line.split()[1]), headers, payload

    def _read(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


GOOD = json.dumps({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}).encode()
CHAT = '{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {}}}]}}]}}'

BAD_BODIES = [
    ("/generate", b'{"text": "a\\ud800b"}', "lone surrogate"),
    ("/generate", b'{"text": "x", "rid": "\\udfff"}', "lone surrogate"),
    ("/v1/chat/completions", CHAT.format('"\\ud800"').encode(), "lone surrogate"),
    ("/v1/chat/completions", CHAT.format('{"a": 1}').encode(), "must be a string"),
    ("/generate", b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
    ("/generate", b'{"text": ' + b"[" * MAX_BODY_DEPTH + b'"x"' + b"]" * MAX_BODY_DEPTH + b"}",
     "nested too deeply"),
    ("/generate", b'{"text": "x", "sampling_params": {"seed": 18446744073709551616}}',
     "64-bit signed integer"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_k": 1180591620717411303424}}',
     "64-bit signed integer"),
    ("/generate", b'{"text": "x", "sampling_params": {"temperature": 1e999}}', "finite"),
    ("/generate", b'{"text": "x", "sampling_params": {"top_p": -1e999}}', "finite"),
    ("/generate", b'{"input_ids": [' + b"9" * 5000 + b"]}", "not valid JSON"),
    ("/v1/completions", b'{"prompt": "x", "seed": -9223372036854775809}', "64-bit"),
    ("/generate", b'{"text": "x", "rid": "' + b"r" * 257 + b'"}', "1 to 256 characters"),
]


@pytest.mark.parametrize("path, body, message", BAD_BODIES)
def test_bad_input_is_a_json_400_and_the_connection_survives(live, path, body, message):
    server, _, engine = live
    conn = Connection(server.url)
    status, headers, payload = conn.request("POST", path, body)
    assert status == 400 and headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert message in error["message"] and error["code"] == 400
    status, _, payload = conn.request("POST", "/generate", GOOD)  # the same connection
    assert status == 200 and json.loads(payload)["meta_info"]["finish_reason"]
    conn.close()
    assert len(engine.submitted) == 1  # only the good request reached the engine


def test_an_internal_error_is_a_json_500_on_a_live_connection(live, monkeypatch):
    server, frontend, _ = live

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    conn = Connection(server.url)
    monkeypatch.setattr(frontend, "prepare", broken)
    for path in ("/generate", "/v1/completions"):
        body = b'{"text": "x"}' if path == "/generate" else b'{"prompt": "x"}'
        status, headers, payload = conn.request("POST", path, body)
        assert status == 500 and headers["content-type"] == "application/json"
        assert json.loads(payload)["error"]["type"] == "server_error"
    monkeypatch.undo()
    status, _, _ = conn.request("POST", "/generate", GOOD)
    assert status == 200
    conn.close()


def test_an_error_inside_a_stream_ends_it_with_an_error_event(live, monkeypatch):
    import httpx

    from tokenizer_proc import http_api

    server, _, _ = live

    def broken(*args, **kwargs):
        raise RuntimeError("a bug while streaming")

    monkeypatch.setattr(http_api.GenerateEvents, "event", broken)
    body = {"input_ids": [5], "stream": True, "sampling_params": {"max_new_tokens": 2}}
    with httpx.stream("POST", server.url + "/generate", json=body, timeout=10) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 500
    assert lines[-1] == "data: [DONE]"
