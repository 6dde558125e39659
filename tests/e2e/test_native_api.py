"""/generate, the ZMQ client, health and stats endpoints, and bad input on a launched server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.e2e

GREEDY = {"max_new_tokens": 12, "temperature": 0}


def test_generate_text_batch_and_stream_agree(default_server):
    url = default_server.url
    single = httpx.post(
        url + "/generate", json={"text": "Hello, my name is", "sampling_params": GREEDY}, timeout=60
    ).json()
    meta = single["meta_info"]
    assert meta["completion_tokens"] == len(single["output_ids"]) > 0
    assert meta["prompt_tokens"] > 0 and meta["e2e_latency"] > 0 and meta["id"]
    assert meta["finish_reason"]["type"] in ("stop", "length")

    batch = httpx.post(
        url + "/generate",
        json={"text": ["Hello, my name is", "2 + 2 ="], "sampling_params": GREEDY},
        timeout=60,
    ).json()
    assert isinstance(batch, list) and len(batch) == 2
    assert batch[0]["output_ids"] == single["output_ids"]

    events = []
    with httpx.stream(
        "POST",
        url + "/generate",
        json={"text": "Hello, my name is", "sampling_params": GREEDY, "stream": True},
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["text"] == single["text"] and last["output_ids"] == single["output_ids"]


def test_zmq_client_matches_http(default_server):
    from aerie.client import AsyncClient, Client

    body = {"text": "The sky is", "sampling_params": GREEDY}
    http = httpx.post(default_server.url + "/generate", json=body, timeout=60).json()
    with Client(default_server.zmq_address) as client:
        out = client.generate(text="The sky is", sampling_params=GREEDY)
        assert out["output_ids"] == http["output_ids"] and out["text"] == http["text"]
        deltas = list(client.stream(text="The sky is", sampling_params=GREEDY))
        assert "".join(d["text"] for d in deltas) == http["text"]
        assert [i for d in deltas for i in d["output_ids"]] == http["output_ids"]

    async def many():
        client = AsyncClient(default_server.zmq_address)
        try:
            return await asyncio.gather(
                *[client.generate(text="The sky is", sampling_params=GREEDY) for _ in range(4)]
            )
        finally:
            client.close()

    assert all(o["output_ids"] == http["output_ids"] for o in asyncio.run(many()))


def test_health_info_and_metrics(default_server):
    url = default_server.url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(url + "/server_info").json()
    assert info["max_total_tokens"] > 0 and info["page_size"] == 1
    # No filesystem paths without --enable-debug-info: the model goes by its served name.
    assert info["served_model_name"] and "/" not in info["served_model_name"]
    assert info["model_path"] == info["served_model_name"]  # SGLang's key, kept for its tools
    assert not [k for k, v in info.items() if isinstance(v, str) and v.startswith("/")]
    metrics = httpx.get(url + "/metrics").text
    for name in ("prompt_tokens", "generation_tokens", "running", "queued", "kv"):
        assert name in metrics, name


BAD_BODIES = [
    ("/generate", {"text": "", "sampling_params": GREEDY}),
    ("/generate", {"input_ids": [], "sampling_params": GREEDY}),
    ("/generate", {"input_ids": [1, 10**9], "sampling_params": GREEDY}),
    ("/generate", {"input_ids": [1, -5], "sampling_params": GREEDY}),
    ("/generate", {"input_ids": [1] * 9000, "sampling_params": GREEDY}),
    ("/generate", {"text": "hi", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 0}}),
    ("/generate", {"text": "hi", "sampling_params": {"top_p": 1.5}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}),
    ("/v1/completions", {"model": "x", "prompt": "hi", "temperature": "hot"}),
    ("/v1/completions", {"model": "x", "prompt": ""}),
    ("/v1/chat/completions", {"model": "x", "messages": "hello"}),
    (
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
    ),
]


@pytest.mark.parametrize("path, body", BAD_BODIES, ids=[f"{p}:{b}"[:60] for p, b in BAD_BODIES])
def test_bad_input_gets_a_clear_4xx(default_server, path, body):
    r = httpx.post(default_server.url + path, json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    error = r.json()["error"]
    message = error["message"] if isinstance(error, dict) else error
    assert isinstance(message, str) and len(message) > 10


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b"null"])
def test_malformed_json_gets_400(default_server, raw):
    for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
        r = httpx.post(
            default_server.url + path,
            content=raw,
            headers={"content-type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, (path, raw, r.text)
        assert "error" in r.json()


def test_server_is_healthy_after_bad_input(default_server):
    url = default_server.url
    for path, body in BAD_BODIES[:4]:
        httpx.post(url + path, json=body, timeout=30)
    assert httpx.get(url + "/health").status_code == 200
    r = httpx.post(url + "/generate", json={"text": "ok", "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] > 0
