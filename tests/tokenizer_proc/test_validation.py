"""Every bad input the frontend must refuse, and what good input turns into."""

from __future__ import annotations

import pytest

from tokenizer_proc.validation import (
    Limits,
    ValidationError,
    build_sampling_params,
    check_prompt_ids,
    parse_generate_body,
    parse_json_object,
)

LIMITS = Limits(vocab_size=100, context_length=32)


def validate(body: dict) -> list:
    """parse + check every item the way the frontend does (ids prompts only)."""
    parsed = parse_generate_body(body)
    out = []
    for item in parsed.items:
        ids = item.prompt if isinstance(item.prompt, list) else [1] * len(item.prompt.split())
        check_prompt_ids(ids, LIMITS)
        out.append(build_sampling_params(item.sampling, len(ids), LIMITS))
    return out


BAD = [
    ({"text": ""}, "text"),
    ({"text": []}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, 100]}, "input_ids"),
    ({"input_ids": [1, -1]}, "input_ids"),
    ({"input_ids": [1] * 32}, "input_ids"),
    ({"input_ids": [1] * 30, "sampling_params": {"max_new_tokens": 3}}, "max_new_tokens"),
    ({"input_ids": "1 2"}, "input_ids"),
    ({"input_ids": [1, 2.5]}, "input_ids"),
    ({"input_ids": [1, True]}, "input_ids"),
    ({"text": "hi", "input_ids": [1]}, "text"),
    ({}, "text"),
    ({"text": "hi", "sampling_params": {"temperature": -0.1}}, "temperature"),
    ({"text": "hi", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_p": 1.01}}, "top_p"),
    ({"text": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
    ({"text": "hi", "sampling_params": {"top_k": -2}}, "top_k"),
    ({"text": "hi", "sampling_params": {"top_k": 1.5}}, "top_k"),
    ({"text": "hi", "sampling_params": {"min_p": -0.1}}, "min_p"),
    ({"text": "hi", "sampling_params": {"min_p": 1.1}}, "min_p"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
    ({"text": "hi", "sampling_params": {"stop": 5}}, "stop"),
    ({"text": "hi", "sampling_params": {"stop": [""]}}, "stop"),
    ({"text": "hi", "sampling_params": {"stop_token_ids": [100]}}, "stop_token_ids"),
    ({"text": "hi", "sampling_params": {"ignore_eos": "yes"}}, "ignore_eos"),
    ({"text": "hi", "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"text": "hi", "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
    ({"text": "hi", "sampling_params": {"n": 2}}, "n"),
    ({"text": "hi", "sampling_params": [{}]}, "sampling_params"),
    ({"text": "hi", "stream": "yes"}, "stream"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "rid": "one"}, "rid"),
]


@pytest.mark.parametrize("body, field", BAD, ids=[str(b)[:50] for b, _ in BAD])
def test_bad_body_raises_naming_the_field(body, field):
    with pytest.raises(ValidationError) as info:
        validate(body)
    assert field in (info.value.param or ""), info.value.param
    assert info.value.status == 400 and len(info.value.message) > 10


@pytest.mark.parametrize("raw", [b"", b"  ", b"{not json", b"[1, 2]", b"null", b"3", b"\xff"])
def test_bad_json_bodies_raise(raw):
    with pytest.raises(ValidationError):
        parse_json_object(raw)


def test_good_body_becomes_sampling_params():
    (params,) = validate(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_new_tokens": 5, "temperature": 0, "top_p": 0.5, "top_k": 4, "min_p": 0.1,
                "stop": "x", "stop_token_ids": [7], "ignore_eos": True, "seed": 3,
                "skip_special_tokens": False, "repetition_penalty": 1.2,
            },
        }
    )  # fmt: skip
    assert params.max_new_tokens == 5 and params.temperature == 0.0 and params.top_p == 0.5
    assert params.top_k == 4 and params.min_p == 0.1 and params.stop == ["x"]
    assert params.stop_token_ids == [7] and params.ignore_eos and params.seed == 3
    assert not params.skip_special_tokens and params.repetition_penalty == 1.2


def test_default_max_new_tokens_is_clamped_to_the_context():
    (params,) = validate({"input_ids": [1] * 30})
    assert params.max_new_tokens == LIMITS.context_length - 30
    (params,) = validate({"input_ids": [1]})
    assert params.max_new_tokens == LIMITS.context_length - 1  # 31 < the default 128


def test_batches_pair_prompts_with_their_parameters():
    body = parse_generate_body(
        {"input_ids": [[1], [2, 3]], "sampling_params": [{"top_k": 2}, {"top_k": 3}],
         "rid": ["a", "b"]}
    )  # fmt: skip
    assert body.is_batch and [i.prompt for i in body.items] == [[1], [2, 3]]
    assert [i.sampling["top_k"] for i in body.items] == [2, 3]
    assert [i.rid for i in body.items] == ["a", "b"]
    shared = parse_generate_body({"text": ["a", "b"], "sampling_params": {"top_k": 2}})
    assert [i.sampling for i in shared.items] == [{"top_k": 2}, {"top_k": 2}]
    assert not parse_generate_body({"text": "a"}).is_batch
