"""The official `openai` client against a launched server on the default model."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client(default_server) -> OpenAI:
    return OpenAI(base_url=default_server.url + "/v1", api_key="none", timeout=120)


def _model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, default_server):
    info = httpx.get(default_server.url + "/server_info").json()
    assert _model(client) == info["served_model_name"] and "/" not in _model(client)


def test_chat_completion_answers_with_usage(client):
    r = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert choice.finish_reason in ("stop", "length")


def test_completion_max_tokens_gives_length(client):
    r = client.completions.create(
        model=_model(client), prompt="Once upon a time", max_tokens=7, temperature=0
    )
    assert r.usage.completion_tokens == 7
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_equals_non_stream_at_temperature_zero(client, kind):
    model = _model(client)
    if kind == "chat":
        kwargs = dict(
            model=model,
            messages=[{"role": "user", "content": "Name three colors."}],
            max_completion_tokens=30,
            temperature=0,
        )
        full = client.chat.completions.create(**kwargs).choices[0].message.content
        chunks = client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            parts += [c.delta.content or "" for c in chunk.choices]
    else:
        kwargs = dict(
            model=model, prompt="The three primary colors are", max_tokens=30, temperature=0
        )
        full = client.completions.create(**kwargs).choices[0].text
        chunks = client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
        parts, usage = [], None
        for chunk in chunks:
            if chunk.usage is not None:
                usage = chunk.usage
            parts += [c.text or "" for c in chunk.choices]
    assert "".join(parts) == full
    assert usage is not None and usage.completion_tokens > 0


def test_stop_string_ends_and_is_trimmed(client):
    model = _model(client)
    base = (
        client.completions.create(
            model=model, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0
        )
        .choices[0]
        .text
    )
    assert " 5" in base, base  # the model counts on; the stop below must cut before it
    r = client.completions.create(
        model=model, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0, stop=[" 5"]
    )
    text = r.choices[0].text
    assert r.choices[0].finish_reason == "stop"
    assert " 5" not in text and base.startswith(text)
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=model,
            prompt="Count: 1, 2, 3,",
            max_tokens=20,
            temperature=0,
            stop=[" 5"],
            stream=True,
        )
        if c.choices
    )
    assert streamed == text


def test_seed_makes_sampling_reproducible(client):
    kwargs = dict(
        model=_model(client),
        prompt="My favourite food is",
        max_tokens=16,
        temperature=1.0,
        seed=1234,
    )
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
