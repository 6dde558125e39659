"""The HTTP and ZMQ edges as an attacker or a careless client meets them: the API key, Host
and content-type checks, size and time limits, overload, unsupported parameters, and
tokenization that never stalls the event loop."""

from __future__ import annotations

import logging
import socket
import threading
import time

import httpx
import msgpack
import pytest
import zmq

from aerie.client import AerieClientError, Client
from tests.tokenizer_proc.harness import LiveServer, dealer, make_frontend, recv, send, wait_until
from tokenizer_proc.http_guard import GuardPolicy
from tokenizer_proc.zmq_frontend import ZmqAccess

KEY = "s3cret-key"
GOOD = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture
def guarded(tokenizer_dir):
    frontend, engine = make_frontend(tokenizer_dir)
    policy = GuardPolicy(KEY, "localhost,127.0.0.1", max_request_bytes=4096, body_timeout_s=1.0)
    with LiveServer(
        frontend, policy, ZmqAccess(api_key=KEY, max_message_bytes=4096), header_timeout_s=1.0
    ) as server:
        yield server, frontend, engine


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_the_api_key_is_required_except_for_health(guarded):
    server, _, engine = guarded
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        r = httpx.post(server.url + "/generate", json=GOOD, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "API key" in r.json()["error"]["message"] and KEY not in r.text
    for path in ("/server_info", "/metrics", "/v1/models", "/health_generate"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert engine.submitted == []
    r = httpx.post(server.url + "/generate", json=GOOD, headers=auth())
    assert r.status_code == 200 and r.json()["output_ids"]


def test_the_openai_client_works_with_the_key(guarded):
    from openai import AuthenticationError, OpenAI

    server, _, _ = guarded
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.url + "/v1", api_key="wrong").models.list()
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt=[5, 6], max_tokens=2)
    assert out.choices[0].text and out.model == model


def test_the_zmq_port_checks_the_key(guarded):
    server, _, engine = guarded
    with Client(server.zmq_address) as client:  # no key: a clear error, not a hang
        with pytest.raises(AerieClientError) as info:
            client.generate(input_ids=[5], timeout=10)
        assert info.value.code == 401
    with Client(server.zmq_address, api_key="nope") as client:
        with pytest.raises(AerieClientError, match="API key"):
            client.generate(input_ids=[5], timeout=10)
    assert engine.submitted == []
    with Client(server.zmq_address, api_key=KEY) as client:
        assert client.generate(input_ids=[5], sampling_params={"max_new_tokens": 2}, timeout=10)[
            "output_ids"
        ]


def test_host_header_and_content_type_stop_browser_driven_requests(guarded):
    server, _, engine = guarded
    r = httpx.post(
        server.url + "/generate", json=GOOD, headers={**auth(), "Host": "attacker.example:30000"}
    )
    assert r.status_code == 403 and "Host" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/generate",
        content=b'{"input_ids": [5]}',
        headers={**auth(), "Content-Type": "text/plain"},
    )
    assert r.status_code == 415
    r = httpx.post(
        server.url + "/generate",
        content=b'{"input_ids": [5]}',
        headers={
            **auth(),
            "Host": "localhost:1234",
            "Content-Type": "application/json; charset=utf-8",
        },
    )
    assert r.status_code == 200
    assert len(engine.submitted) == 1


def test_bodies_over_the_limit_are_413_before_parsing(guarded):
    server, _, engine = guarded
    big = b'{"text": "' + b"a" * 5000 + b'"}'
    r = httpx.post(
        server.url + "/generate",
        content=big,
        headers={**auth(), "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and "--max-request-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while reading
        for _ in range(10):
            yield b" " * 1000

    r = httpx.post(
        server.url + "/generate",
        content=chunks(),
        headers={**auth(), "Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert engine.submitted == []


def test_a_slow_body_gets_408_and_an_idle_connection_is_closed(guarded):
    server, _, _ = guarded
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        head = (
            f"POST /generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        slow.sendall(head.encode())
        reply = slow.recv(4096).decode()  # the body never completes
        assert reply.startswith("HTTP/1.1 408")
    with socket.create_connection((host, int(port)), timeout=10) as idle:
        start = time.monotonic()
        assert idle.recv(1) == b""  # closed by the server: no request head within 1 s
        assert time.monotonic() - start < 5
    with socket.create_connection((host, int(port)), timeout=10) as slowloris:
        slowloris.sendall(b"GET /health HTTP/1.1\r\n")
        time.sleep(0.3)
        slowloris.sendall(b"Host: localhost\r\n")  # ... and never the end of the head
        assert slowloris.recv(1) == b""


def test_a_generation_longer_than_the_body_timeout_completes(guarded):
    """The body deadline ends with the body: a handler that then waits on the connection for
    a disconnect, while a slow generation runs, must not get a 408 (it did, with an empty
    response, for every non-streaming request longer than --body-timeout-s)."""
    server, _, engine = guarded  # body timeout 1 s
    engine.delay_s = 0.5
    body = {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4}}
    r = httpx.post(server.url + "/generate", json=body, headers=auth(), timeout=30)
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text


def test_connections_beyond_the_cap_get_a_json_503(tokenizer_dir):
    """--max-connections N serves N connections and refuses the N+1-th (uvicorn's own limit
    refused the N-th, in text/plain)."""
    frontend, _ = make_frontend(tokenizer_dir)
    with LiveServer(frontend, max_connections=2, header_timeout_s=5.0) as server:
        host, port = server.url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))  # the first connection
        try:
            with (
                httpx.Client(base_url=server.url) as second,
                httpx.Client(base_url=server.url) as third,
            ):
                assert second.get("/health").status_code == 200  # the N-th is served
                r = third.get("/health")
                assert r.status_code == 503 and r.headers["retry-after"] == "1"
                assert "--max-connections" in r.json()["error"]["message"]
                assert second.get("/health").status_code == 200  # still served
        finally:
            idle.close()
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 200)


def test_a_client_that_leaves_mid_upload_costs_one_log_line(guarded, caplog):
    server, _, _ = guarded
    host, port = server.url.removeprefix("http://").split(":")
    caplog.set_level(logging.INFO)
    with socket.create_connection((host, int(port))) as gone:
        gone.sendall(
            (
                f"POST /generate HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer "
                f"{KEY}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                '{"input'
            ).encode()
        )
        time.sleep(0.2)
    assert wait_until(lambda: any("went away" in r.message for r in caplog.records))
    assert not any(r.exc_info for r in caplog.records)
    assert httpx.get(server.url + "/health").status_code == 200


def test_an_oversized_zmq_frame_drops_that_connection_only(guarded):
    server, _, _ = guarded
    flooder, other = dealer(server.zmq_address), dealer(server.zmq_address)
    flooder.send(
        msgpack.packb(
            {"op": "generate", "req_id": 1, "api_key": KEY, "body": {"text": "x" * 100_000}}
        )
    )
    with pytest.raises(zmq.Again):
        recv(flooder)  # disconnected before the frame was buffered: no reply at all
    send(other, {"op": "generate", "req_id": 2, "api_key": KEY, "body": GOOD})
    assert recv(other)["event"] == "done"
    flooder.close()
    other.close()


def test_unimplemented_and_unknown_parameters_are_named_not_ignored(live):
    server, _, engine = live
    cases = [
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"logit_bias": {"5": 10}}, "logit_bias"),
        ("/v1/chat/completions", {"not_a_param": 1}, "not_a_param"),
        ("/generate", {"lora_path": "x"}, "lora_path"),
    ]
    for path, extra, param in cases:
        base = {
            "/generate": {"input_ids": [5]},
            "/v1/completions": {"prompt": "hi"},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        }
        r = httpx.post(server.url + path, json={**base[path], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "tools": [],
            "user": "someone",
        },
    )
    assert ok.status_code == 200  # empty or harmless fields are fine
    assert len(engine.submitted) == 1


def test_responses_name_the_served_model_never_a_path(live):
    server, frontend, _ = live
    frontend.model_name = "tiny-model"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "/some/path", "prompt": "hi", "max_tokens": 1},
    )
    assert r.json()["model"] == "tiny-model"
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == "tiny-model"


def test_batches_are_bounded_and_an_overloaded_server_says_when_to_retry(live):
    server, frontend, engine = live
    r = httpx.post(server.url + "/generate", json={"input_ids": [[5]] * 65})
    assert r.status_code == 400 and "at most 64" in r.json()["error"]["message"]
    engine.hold = True
    frontend.limits = frontend.limits.__class__(**{**frontend.limits.__dict__, "max_in_flight": 2})
    held = [
        threading.Thread(
            target=httpx.post,
            args=(server.url + "/generate",),
            kwargs={"json": {"input_ids": [5]}, "timeout": 30},
        )
        for _ in range(2)
    ]
    for t in held:
        t.daemon = True
        t.start()
    assert wait_until(lambda: frontend.tracker.num_in_flight == 2)
    r = httpx.post(server.url + "/generate", json={"input_ids": [5]})
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert "overloaded" in r.json()["error"]["message"]


def test_requests_that_tokenize_concurrently_cannot_overrun_the_cap(live, monkeypatch):
    """Both requests pass the early check while the first is still tokenizing (nothing is in
    flight yet); the check when they are registered admits one and refuses the other."""
    server, frontend, engine = live
    engine.hold = True
    frontend.limits = frontend.limits.__class__(**{**frontend.limits.__dict__, "max_in_flight": 1})
    release, checks = threading.Event(), []
    original_encode, original_check = frontend.tokenizer.encode, frontend.check_accepting

    def slow_encode(text):
        release.wait(10)
        return original_encode(text)

    def counted_check(num_new=1):
        checks.append(num_new)
        original_check(num_new)

    monkeypatch.setattr(frontend.tokenizer, "encode", slow_encode)
    monkeypatch.setattr(frontend, "check_accepting", counted_check)
    results = []

    def post():
        results.append(
            httpx.post(
                server.url + "/generate",
                json={"text": "hello", "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            )
        )

    threads = [threading.Thread(target=post, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(checks) >= 2)  # both admitted before either is tokenized
    release.set()
    assert wait_until(lambda: len(results) == 1)
    assert results[0].status_code == 503 and "overloaded" in results[0].json()["error"]["message"]
    assert frontend.tracker.num_in_flight == 1


def test_tokenizing_a_long_prompt_does_not_stall_the_server(live, monkeypatch):
    """Tokenization runs off the event loop: /health answers while it runs; a text that
    cannot fit the context is refused by its byte length without tokenizing at all."""
    server, frontend, _ = live
    entered, release = threading.Event(), threading.Event()
    original = frontend.tokenizer.encode

    def slow_encode(text):
        entered.set()
        release.wait(10)
        return original(text)

    monkeypatch.setattr(frontend.tokenizer, "encode", slow_encode)
    result = []
    worker = threading.Thread(
        target=lambda: result.append(
            httpx.post(
                server.url + "/generate",
                json={"text": "hello", "sampling_params": {"max_new_tokens": 2}},
                timeout=30,
            )
        )
    )
    worker.start()
    assert entered.wait(5)
    assert httpx.get(server.url + "/health", timeout=2).status_code == 200  # not stalled
    release.set()
    worker.join(10)
    assert result[0].status_code == 200
    entered.clear()
    too_long = "x" * (frontend.limits.max_prompt_bytes + 1)
    r = httpx.post(server.url + "/generate", json={"text": too_long}, timeout=10)
    assert r.status_code == 400 and "bytes" in r.json()["error"]["message"]
    assert not entered.is_set()  # never tokenized


def test_curve_encryption_and_a_clear_error_for_a_missing_or_wrong_server_key(tokenizer_dir):
    import asyncio

    from aerie.client import AsyncClient

    public, secret = zmq.curve_keypair()
    frontend, _ = make_frontend(tokenizer_dir)
    with LiveServer(frontend, access=ZmqAccess(curve=(public, secret))) as server:
        with Client(server.zmq_address, server_public_key=public) as client:
            out = client.generate(input_ids=[5], sampling_params={"max_new_tokens": 2}, timeout=10)
            assert out["output_ids"]
        for key in (None, zmq.curve_keypair()[0]):  # no key; the wrong key
            with Client(server.zmq_address, server_public_key=key) as client:
                with pytest.raises(AerieClientError, match="handshake"):
                    client.generate(input_ids=[5], timeout=10)

        async def without_key() -> None:
            client = AsyncClient(server.zmq_address)
            try:
                await client.generate(input_ids=[5], timeout=10)
            finally:
                client.close()

        with pytest.raises(AerieClientError, match="handshake"):
            asyncio.run(without_key())


def test_a_chat_too_big_for_the_context_is_refused_before_rendering(live, monkeypatch):
    """250,000 empty messages (8 MB) were rendered and tokenized (750,000 tokens, seconds of
    CPU) before the 400: the message count and each message's template tokens are now held
    against the context first."""
    server, frontend, engine = live
    rendered = []
    original = frontend.tokenizer.encode_chat
    monkeypatch.setattr(
        frontend.tokenizer,
        "encode_chat",
        lambda messages: rendered.append(len(messages)) or original(messages),
    )
    per_message = frontend.tokenizer.chat_tokens_per_message
    most = (frontend.limits.context_length - 1) // per_message
    empty, long = {"role": "user", "content": ""}, "x" * frontend.limits.max_prompt_bytes
    for messages in ([empty] * 250_000, [empty] * (most + 1), [{"role": "user", "content": long}]):
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
        assert "context" in r.json()["error"]["message"]
    assert rendered == [] and engine.submitted == []
    ok = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}] * 2, "max_tokens": 1},
    )
    assert ok.status_code == 200 and rendered == [2]


def test_chat_errors_name_the_served_model_never_a_path(live, monkeypatch, tokenizer_dir):
    """The error for a model without a chat template named the tokenizer's directory."""
    server, frontend, _ = live
    frontend.model_name = "tiny-model"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    monkeypatch.setattr(frontend.tokenizer._tok, "chat_template", None)
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "'tiny-model' has no chat template" in r.text
    assert "/v1/completions" in r.text and tokenizer_dir not in r.text
    refusing = "{{ raise_exception('roles must alternate') }}"
    monkeypatch.setattr(frontend.tokenizer._tok, "chat_template", refusing)
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and "roles must alternate" in r.json()["error"]["message"]
    assert "tiny-model" in r.text and tokenizer_dir not in r.text


@pytest.mark.parametrize("stage", ["parse", "render"])
def test_a_big_chat_does_not_stall_the_server(live, monkeypatch, stage):
    """A large body is parsed and checked in a thread (walking 250,000 messages took most of
    a second on the event loop), and the chat template renders in one: /health answers
    while either runs."""
    from tokenizer_proc import http_api

    server, frontend, _ = live
    entered, release = threading.Event(), threading.Event()
    module, name = (
        (http_api, "parse_json_object") if stage == "parse" else (frontend.tokenizer, "encode_chat")
    )
    original = getattr(module, name)

    def blocking(value):
        entered.set()
        release.wait(10)
        return original(value)

    monkeypatch.setattr(module, name, blocking)
    filler = [{"role": "system", "content": "x" * 100}] * (600 if stage == "parse" else 0)
    body = {"messages": [*filler, {"role": "user", "content": "hi"}], "max_tokens": 1}
    if stage == "render":
        body["messages"] = [{"role": "user", "content": "hi"}]
    result: list = []
    worker = threading.Thread(
        target=lambda: result.append(
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
        )
    )
    worker.start()
    try:
        assert entered.wait(10)
        assert httpx.get(server.url + "/health", timeout=2).status_code == 200  # not stalled
    finally:
        release.set()
        worker.join(30)
    assert result[0].status_code in (200, 400)  # answered either way (600 messages: 400)
