"""Every error is a JSON body in the API's error format, and the keep-alive connection that
carried the bad request keeps working (checked on one raw socket); no response holds NaN or
an infinity."""

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
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
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
    (
        "/generate",
        b'{"text": ' + b"[" * MAX_BODY_DEPTH + b'"x"' + b"]" * MAX_BODY_DEPTH + b"}",
        "nested too deeply",
    ),
    (
        "/generate",
        b'{"text": "x", "sampling_params": {"seed": 18446744073709551616}}',
        "64-bit signed integer",
    ),
    (
        "/generate",
        b'{"text": "x", "sampling_params": {"top_k": 1180591620717411303424}}',
        "64-bit signed integer",
    ),
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


@pytest.mark.parametrize(
    "method, path, status, allow",
    [
        ("GET", "/nope", 404, None),
        ("POST", "/v1/nope", 404, None),
        ("GET", "/generate", 405, "POST"),
        ("POST", "/v1/models", 405, "GET"),
    ],
)
def test_unknown_paths_and_methods_get_the_api_error_format(live, method, path, status, allow):
    """404 and 405 came as FastAPI's {"detail": ...}, a shape no OpenAI client reads."""
    server, _, _ = live
    conn = Connection(server.url)
    code, headers, payload = conn.request(method, path, b"{}" if method == "POST" else b"")
    assert code == status and headers["content-type"] == "application/json"
    error = json.loads(payload)["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error"
    assert path in error["message"] and "detail" not in json.loads(payload)
    if allow:
        assert headers["allow"] == allow and f"use {allow}" in error["message"]
    else:
        assert "/v1/chat/completions" in error["message"]  # where to go instead
    assert conn.request("POST", "/generate", GOOD)[0] == 200  # the same connection
    conn.close()


def test_a_malformed_request_gets_a_json_400(live):
    server, _, _ = live
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
    assert json.loads(body)["error"]["code"] == 400


def test_requests_cut_off_by_uvicorns_shutdown_get_a_503_not_a_text_500(tokenizer_dir):
    """What is still running when uvicorn's graceful shutdown times out is cancelled; that
    used to end in uvicorn's text/plain 500 (or a stream cut without an end)."""
    import threading

    import httpx

    from tests.tokenizer_proc.harness import LiveServer, make_frontend, wait_until

    frontend, engine = make_frontend(tokenizer_dir)
    engine.hold = True  # nothing finishes
    with LiveServer(frontend) as server:
        results: list = []
        plain = threading.Thread(
            target=lambda: results.append(
                httpx.post(server.url + "/v1/completions", json={"prompt": [5]}, timeout=30)
            )
        )
        plain.start()
        with httpx.stream(
            "POST", server.url + "/generate", timeout=30, json={"input_ids": [6], "stream": True}
        ) as stream:
            assert wait_until(lambda: frontend.tracker.num_in_flight == 2)
            server._server.should_exit = True
            lines = [line for line in stream.iter_lines() if line]
        plain.join(30)
    assert results[0].status_code == 503
    assert results[0].json()["error"]["type"] == "service_unavailable"
    assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == 503
    assert lines[-1] == "data: [DONE]"


def strict_json(text: str | bytes):
    """json.loads refusing NaN and the infinities (which Python's parser accepts)."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} in a response")

    return json.loads(text, parse_constant=refuse)


def logprob_responses(url: str) -> dict[str, list]:
    """Every shape logprobs take: (non-)streamed /generate, completions and chat; each entry
    is the response's JSON documents, parsed strictly."""
    import httpx

    generate = {"input_ids": [5], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    chat = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 1,
    }
    completion = {"prompt": [5], "max_tokens": 2, "logprobs": 1}
    out = {}
    for name, path, body in [
        ("generate", "/generate", generate),
        ("chat", "/v1/chat/completions", chat),
        ("completion", "/v1/completions", completion),
    ]:
        out[name] = [strict_json(httpx.post(url + path, json=body, timeout=10).content)]
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=10) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        out[name + "_stream"] = [strict_json(e) for e in events if e != "[DONE]"]
    return out


def test_a_zero_probability_logprob_is_reported_as_the_floor_in_every_shape(live, monkeypatch):
    """-inf (a token of zero probability) was written as -Infinity in streams (not JSON) and
    made non-streamed responses 500. Every shape now reports -9999.0."""
    from tests.tokenizer_proc import harness

    server, _, _ = live
    monkeypatch.setattr(harness, "LOGPROB", float("-inf"))
    responses = logprob_responses(server.url)
    for name, docs in responses.items():
        text = json.dumps(docs)
        assert "-9999.0" in text, name
        assert "-0.5" not in text  # every logprob was floored


def test_a_nan_logprob_fails_loudly_never_as_invalid_json(live, monkeypatch):
    """NaN would be a worker bug: it must not reach a client as `NaN` (invalid JSON). The
    strict encoding turns it into a 500 (an error event in a stream)."""
    import httpx

    from tests.tokenizer_proc import harness

    server, _, _ = live
    monkeypatch.setattr(harness, "LOGPROB", float("nan"))
    body = {"input_ids": [5], "return_logprob": True, "sampling_params": {"max_new_tokens": 2}}
    r = httpx.post(server.url + "/generate", json=body, timeout=10)
    assert r.status_code == 500 and strict_json(r.content)["error"]["code"] == 500
    for path, extra in [("/generate", {}), ("/v1/completions", {"prompt": [5], "logprobs": 1})]:
        request = {**body, "stream": True} if not extra else {**extra, "stream": True}
        with httpx.stream("POST", server.url + path, json=request, timeout=10) as r:
            events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert events[-1] == "[DONE]" and strict_json(events[-2])["error"]["code"] == 500
        for event in events[:-1]:
            strict_json(event)
