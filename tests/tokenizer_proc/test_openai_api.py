"""OpenAI-compatible routes, driven by the official `openai` client against a live server."""

from __future__ import annotations

import httpx
import openai
import pytest

from aerie.codec import unpack_ids
from tests.tokenizer_proc.harness import LOGPROB, fake_output_ids, fake_text

MESSAGES = [{"role": "user", "content": "Hello world"}]


@pytest.fixture
def client(live):
    server, _, _ = live
    with openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as c:
        yield c


def test_models_lists_the_served_model(live, client):
    _, frontend, _ = live
    assert [m.id for m in client.models.list().data] == [frontend.model_name]


def test_completion_maps_parameters_and_reports_usage(live, client):
    _, frontend, engine = live
    r = client.completions.create(
        model="m",
        prompt="Hello world",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=["x", "yz"],
        frequency_penalty=0.5,
        extra_body={"top_k": 4, "min_p": 0.1, "ignore_eos": True, "stop_token_ids": [3]},
    )
    (request,) = engine.submitted
    s = request.sampling
    assert unpack_ids(request.input_ids) == frontend.tokenizer.encode("Hello world")
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed) == (5, 0.5, 0.9, 7)
    assert s.stop == ["x", "yz"] and s.frequency_penalty == 0.5
    assert (s.top_k, s.min_p, s.ignore_eos, s.stop_token_ids) == (4, 0.1, True, [3])
    assert r.choices[0].text == fake_text(fake_output_ids(request))
    assert r.choices[0].finish_reason == "length" and r.object == "text_completion"
    assert r.usage.completion_tokens == 5
    assert r.usage.prompt_tokens == len(unpack_ids(request.input_ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5


def test_completion_defaults_to_16_tokens_and_takes_token_prompts(client, live):
    _, _, engine = live
    client.completions.create(model="m", prompt=[5, 6, 7])
    assert engine.submitted[0].sampling.max_new_tokens == 16
    assert unpack_ids(engine.submitted[0].input_ids) == [5, 6, 7]


def test_chat_completion_uses_the_chat_template(live, client):
    _, frontend, engine = live
    r = client.chat.completions.create(model="m", messages=MESSAGES, max_completion_tokens=3)
    (request,) = engine.submitted
    assert unpack_ids(request.input_ids) == frontend.tokenizer.encode_chat(MESSAGES)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == fake_text(fake_output_ids(request))
    assert r.object == "chat.completion" and r.usage.completion_tokens == 3


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_with_usage_equals_non_stream(client, kind):
    if kind == "chat":
        create = lambda **kw: client.chat.completions.create(messages=MESSAGES, **kw)  # noqa: E731
        text_of = lambda c: c.delta.content or ""  # noqa: E731
        full = create(model="m", max_tokens=5).choices[0].message.content
    else:
        create = lambda **kw: client.completions.create(prompt="Hello world", **kw)  # noqa: E731
        text_of = lambda c: c.text or ""  # noqa: E731
        full = create(model="m", max_tokens=5).choices[0].text
    chunks = list(
        create(model="m", max_tokens=5, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(text_of(c) for ch in chunks for c in ch.choices) == full
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(ch.usage is None for ch in chunks[:-1])
    finishes = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finishes == ["length"]
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].object == "chat.completion.chunk"


def test_stream_without_include_usage_has_no_usage_chunk(client):
    chunks = list(client.completions.create(model="m", prompt="Hi", max_tokens=3, stream=True))
    assert all(ch.choices for ch in chunks)


def test_logprobs(client, live):
    _, frontend, engine = live
    r = client.chat.completions.create(
        model="m", messages=MESSAGES, max_tokens=3, logprobs=True, top_logprobs=1
    )
    ids = fake_output_ids(engine.submitted[0])
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [LOGPROB] * 3
    assert [c.token for c in content] == frontend.tokenizer.token_strings(ids)
    assert [c.top_logprobs[0].logprob for c in content] == [LOGPROB] * 3
    r = client.completions.create(model="m", prompt="Hi", max_tokens=3, logprobs=1)
    assert r.choices[0].logprobs.token_logprobs == [LOGPROB] * 3
    assert r.choices[0].logprobs.text_offset[0] == 0


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.completions.create(model="m", prompt="Hi", n=2),
        lambda c: c.chat.completions.create(model="m", messages=MESSAGES, n=2),
        lambda c: c.completions.create(model="m", prompt=""),
        lambda c: c.completions.create(model="m", prompt="Hi", temperature=-1),
        lambda c: c.completions.create(model="m", prompt="Hi", max_tokens=1000),
        lambda c: c.chat.completions.create(model="m", messages=[]),
        lambda c: c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=-3),
        lambda c: c.chat.completions.create(
            model="m", messages=[{"role": "robot", "content": "x"}]
        ),
    ],
)
def test_bad_requests_raise_bad_request(client, live, call):
    with pytest.raises(openai.BadRequestError) as info:
        call(client)
    assert len(info.value.body["message"]) > 10
    assert live[2].submitted == []


def test_bad_types_name_the_field(live):
    server, _, _ = live
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": -3}
    )
    assert r.json()["error"]["param"] == "max_tokens" and "max_tokens" in r.text
