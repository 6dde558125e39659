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


def test_every_string_is_checked_however_long_the_list_of_numbers_beside_it():
    """Lists of numbers are passed over whole; a string among numbers is still checked, at
    its path."""
    ids = list(range(5000))
    assert parse_json_object(b'{"input_ids": %s}' % str(ids).encode())["input_ids"] == ids
    raw = b'{"input_ids": [1, 2.5, true, null, [3, "\\ud800"]]}'
    with pytest.raises(ValidationError, match=r"input_ids\[4\]\[1\] holds a lone surrogate"):
        parse_json_object(raw)


def test_good_body_becomes_sampling_params():
    (params,) = validate(
        {
            "input_ids": [1, 2, 3],
            "sampling_params": {
                "max_new_tokens": 5,
                "temperature": 0,
                "top_p": 0.5,
                "top_k": 4,
                "min_p": 0.1,
                "stop": "x",
                "stop_token_ids": [7],
                "ignore_eos": True,
                "seed": 3,
                "skip_special_tokens": False,
                "repetition_penalty": 1.2,
            },
        }
    )
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
        {
            "input_ids": [[1], [2, 3]],
            "sampling_params": [{"top_k": 2}, {"top_k": 3}],
            "rid": ["a", "b"],
        }
    )
    assert body.is_batch and [i.prompt for i in body.items] == [[1], [2, 3]]
    assert [i.sampling["top_k"] for i in body.items] == [2, 3]
    assert [i.rid for i in body.items] == ["a", "b"]
    shared = parse_generate_body({"text": ["a", "b"], "sampling_params": {"top_k": 2}})
    assert [i.sampling for i in shared.items] == [{"top_k": 2}, {"top_k": 2}]
    assert not parse_generate_body({"text": "a"}).is_batch


FLOAT_PARAMS = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
EXTREMES = (
    1e-300,
    1e-50,
    1e-45,
    1e-40,
    1e-38,
    1e-30,
    1e-21,
    1e-20,
    1e-6,
    0.3,
    1.0,
    2.0,
    3.4e38,
    3.5e38,
    1e300,
)


@pytest.mark.parametrize("key", FLOAT_PARAMS)
def test_every_accepted_float_gives_the_worker_finite_logprobs(key):
    """Values valid as 64-bit floats can round to 0 or inf in the worker's float32: top_p
    1e-50 made top-p keep no token and repetition_penalty 1e-50 divided by zero (NaN logprobs,
    and a 500 for return_logprob). Whatever validation accepts, alone or with the smallest
    sampled temperature, the worker's sampler gives a finite logprob, even where every token
    is penalised and logits are large."""
    import torch

    from gpu_worker.sampling import GREEDY_EPS, SamplingState

    logits = torch.linspace(-500.0, 500.0, LIMITS.vocab_size)[None]  # [1, V]
    for value, temperature in [(v, t) for v in EXTREMES for t in (1.0, GREEDY_EPS)]:
        raw = {"temperature": temperature, "seed": 7, key: value}
        try:
            params = build_sampling_params(raw, 1, LIMITS)
        except ValidationError as e:
            assert e.param == f"sampling_params.{key}" and "must be in [" in e.message
            continue
        state = SamplingState(max_rows=1, vocab_size=LIMITS.vocab_size, device="cpu")
        state.start(1, params, list(range(LIMITS.vocab_size)), 0)
        _, logprobs = state.sample(logits, torch.tensor([1]), torch.tensor([3]))
        assert torch.isfinite(logprobs).all(), (key, value, temperature, logprobs)


def test_a_value_that_float32_rounds_out_of_range_is_refused_with_the_range():
    for key, value in [("top_p", 1e-50), ("repetition_penalty", 1e-50), ("temperature", 1e39)]:
        with pytest.raises(ValidationError) as info:
            build_sampling_params({key: value}, 1, LIMITS)
        assert info.value.message.startswith(f"sampling_params.{key} must be in [")
        assert info.value.message.endswith(f"got {value}")
    assert build_sampling_params({"top_p": 1e-20}, 1, LIMITS).top_p == 1e-20
