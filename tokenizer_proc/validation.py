"""Pure checks that turn request bodies into prompts and `SamplingParams`, or raise
`ValidationError(message, param)` (a 400 with an OpenAI-style body). Nothing here touches
sockets or the tokenizer; keys use the native names, onto which the OpenAI parsers map theirs.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any

from aerie.messages import SamplingParams

SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__)  # type: ignore[attr-defined]
_DEFAULTS = SamplingParams()  # every default is written once, in aerie.messages

# The worker samples in float32, so ranges are checked on the float32 value. top_p and
# repetition_penalty also have floors: below them top_p times a token's probability (at least
# 1 / vocabulary) or a logit divided by the penalty leaves the normal float32 range, which
# makes top-p keep no token or the penalty divide by zero, and the logprobs NaN.
FLOAT32_MAX = 3.4028234663852886e38
MIN_TOP_P = 1e-20
MIN_REPETITION_PENALTY = 1e-20


class ValidationError(ValueError):
    """A request that cannot be served. status is the HTTP status (400 unless said
    otherwise); retry_after, for 503s, how many seconds a client should wait."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.retry_after = retry_after


def error_body(message: str, param: str | None, status: int) -> dict[str, Any]:
    """OpenAI-style error JSON."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 503:
        kind = "service_unavailable"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    context_length: int
    max_batch_size: int = 64  # prompts in one /generate batch
    max_in_flight: int | None = None  # requests running or queued; more get 503
    max_token_bytes: int = 64  # the longest token's UTF-8 bytes (for the byte pre-check)

    @property
    def max_prompt_bytes(self) -> int:
        """A longer text needs more tokens than the context holds, whatever the tokenizer
        makes of it (each token covers at most max_token_bytes bytes)."""
        return self.context_length * self.max_token_bytes


@dataclass(frozen=True)
class GenerateItem:
    """One request of a native /generate body. prompt: text or token ids (not yet checked)."""

    prompt: str | list[int]
    sampling: dict[str, Any]
    rid: str | None


@dataclass(frozen=True)
class GenerateBody:
    items: list[GenerateItem]
    is_batch: bool
    stream: bool
    return_logprob: bool


# --------------------------------------------------------------------------------------------
# Typed field readers: None (or a missing key) means "use the default".


MAX_BODY_DEPTH = 32  # nesting of objects and arrays in a request body
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; empty, malformed or non-object bodies raise, and so
    do bodies nested deeper than MAX_BODY_DEPTH or holding strings that are not valid Unicode
    (a lone surrogate escape such as "\\ud800" parses, but no tokenizer or encoder takes it)."""
    if not raw.strip():
        raise ValidationError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except ValueError as e:  # malformed JSON, invalid UTF-8, an integer too long to parse
        raise ValidationError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ValidationError(
            f"the request body is nested too deeply (at most {MAX_BODY_DEPTH} levels)"
        ) from None
    if not isinstance(body, dict):
        raise ValidationError(f"the request body must be a JSON object, not {kind_of(body)}")
    check_json_values(body)
    return body


SCALARS = {int, float, bool, type(None)}


def check_json_values(body: Any) -> None:
    """Raise unless body is at most MAX_BODY_DEPTH deep and every string (keys included) is
    valid Unicode. Iterative, so a deep body cannot exhaust the stack."""
    stack = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_unicode(value, path or "body")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_BODY_DEPTH:
                raise ValidationError(
                    f"the request body is nested too deeply (at most {MAX_BODY_DEPTH} levels)"
                )
            if isinstance(value, dict):
                for key, item in value.items():
                    _check_unicode(key, path or "body")
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
            elif not set(map(type, value)) <= SCALARS:  # a list of numbers (token ids) is
                stack.extend(  # passed over at C speed: nothing in it to check
                    (item, f"{path}[{i}]", depth + 1)
                    for i, item in enumerate(value)
                    if isinstance(item, (str, dict, list))
                )


def _check_unicode(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(
            f"{param[:100]} holds a lone surrogate (\\ud800-\\udfff): not valid Unicode",
            param[:100],
        ) from None


def kind_of(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "a number"
    return names.get(type(value), type(value).__name__)


def read_bool(body: dict, key: str, default: bool, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        param = param or key
        raise ValidationError(f"{param} must be a boolean, got {kind_of(value)}", param)
    return value


def read_int(body: dict, key: str, default: int | None, param: str | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValidationError(
            f"{param or key} must be an integer, got {kind_of(value)}", param or key
        )
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValidationError(
            f"{param or key} must be a 64-bit signed integer (at most {INT64_MAX})", param or key
        )
    return value


def read_float(body: dict, key: str, default: float, param: str | None = None) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        param = param or key
        raise ValidationError(f"{param} must be a number, got {kind_of(value)}", param)
    try:
        number = float(value)
    except OverflowError:  # an integer beyond the float range
        number = math.inf
    if not math.isfinite(number):
        raise ValidationError(f"{param or key} must be a finite number, got {value}", param or key)
    return number


def as_float32(value: float) -> float:
    """value rounded to float32, as the worker holds it (+-inf beyond the float32 range)."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def read_str(body: dict, key: str, param: str | None = None) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        param = param or key
        raise ValidationError(f"{param} must be a string, got {kind_of(value)}", param)
    return value


def is_id_list(value: Any) -> bool:
    """A list of ints (JSON gives exact ints; a bool is not one)."""
    return isinstance(value, list) and set(map(type, value)) <= {int}


# --------------------------------------------------------------------------------------------
# Prompts and sampling parameters


def check_prompt_ids(ids: list[int], limits: Limits, param: str = "input_ids") -> None:
    """Raise unless ids is a non-empty in-vocabulary prompt shorter than the context."""
    if not ids:
        raise ValidationError(f"{param} is empty; the prompt needs at least one token", param)
    _check_vocab(ids, limits, param)
    if len(ids) >= limits.context_length:
        raise ValidationError(
            f"the prompt has {len(ids)} tokens; the context length is {limits.context_length} "
            "(prompt + output must fit)",
            param,
        )


def max_chat_messages(tokens_per_message: int, limits: Limits) -> int:
    """The most messages that can fit the context when each costs at least tokens_per_message
    tokens of chat template."""
    return (limits.context_length - 1) // tokens_per_message


def check_chat_size(
    messages: list[dict[str, str]], tokens_per_message: int, limits: Limits
) -> None:
    """Raise unless messages may fit the context, before anything renders or tokenizes them:
    each costs at least tokens_per_message tokens of chat template, and its content at least
    one token per max_token_bytes bytes (so empty messages count too)."""
    num_bytes = sum(len(m["content"].encode("utf-8")) for m in messages)
    min_tokens = len(messages) * tokens_per_message + -(-num_bytes // limits.max_token_bytes)
    if min_tokens >= limits.context_length:
        raise ValidationError(
            f"the {len(messages)} messages ({num_bytes} bytes of content) take at least "
            f"{min_tokens} tokens with the chat template; the context length is "
            f"{limits.context_length}: send fewer or shorter messages",
            "messages",
        )


def build_sampling_params(
    raw: dict[str, Any], prompt_len: int, limits: Limits, prefix: str = "sampling_params."
) -> SamplingParams:
    """SamplingParams from native-named keys, checked against the prompt and the limits.

    A missing max_new_tokens defaults to 128, clamped to what is left of the context; an
    explicit one that does not fit is an error.
    """
    if not isinstance(raw, dict):
        raise ValidationError(f"{prefix.rstrip('.')} must be an object", prefix.rstrip("."))
    unknown = sorted(set(raw) - SAMPLING_KEYS)
    if unknown:
        raise ValidationError(f"unknown sampling parameter {unknown[0]!r}", prefix + unknown[0])
    p = lambda key: prefix + key  # noqa: E731
    room = limits.context_length - prompt_len
    max_new_tokens = read_int(raw, "max_new_tokens", None, p("max_new_tokens"))
    if max_new_tokens is None:
        max_new_tokens = min(_DEFAULTS.max_new_tokens, room)
    d = _DEFAULTS

    def num(read, key: str):  # noqa: ANN001, ANN202
        return read(raw, key, getattr(d, key), p(key))

    params = SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=num(read_float, "temperature"),
        top_p=num(read_float, "top_p"),
        top_k=num(read_int, "top_k"),
        min_p=num(read_float, "min_p"),
        stop=_read_stop(raw, p("stop")),
        stop_token_ids=_read_ids(raw, "stop_token_ids", p("stop_token_ids")),
        ignore_eos=num(read_bool, "ignore_eos"),
        skip_special_tokens=num(read_bool, "skip_special_tokens"),
        seed=num(read_int, "seed"),
        frequency_penalty=num(read_float, "frequency_penalty"),
        presence_penalty=num(read_float, "presence_penalty"),
        repetition_penalty=num(read_float, "repetition_penalty"),
    )
    _check_ranges(params, raw, prefix)
    _check_vocab(params.stop_token_ids, limits, p("stop_token_ids"))
    if params.max_new_tokens > room:
        raise ValidationError(
            f"the prompt ({prompt_len} tokens) + max_new_tokens ({params.max_new_tokens}) is "
            f"more than the context length ({limits.context_length}); lower max_new_tokens to "
            f"at most {room}",
            p("max_new_tokens"),
        )
    return params


def _check_ranges(s: SamplingParams, raw: dict, prefix: str) -> None:
    """Ranges of s, its floats checked as the worker holds them (bounds and values rounded to
    float32); errors quote the value as sent."""

    def within(key: str, low: float, high: float) -> bool:
        return as_float32(low) <= as_float32(getattr(s, key)) <= as_float32(high)

    checks = [
        ("max_new_tokens", s.max_new_tokens >= 1, "must be >= 1"),
        (
            "temperature",
            within("temperature", 0.0, FLOAT32_MAX),
            f"must be in [0, {FLOAT32_MAX:g}]",
        ),
        ("top_p", within("top_p", MIN_TOP_P, 1.0), f"must be in [{MIN_TOP_P:g}, 1]"),
        ("top_k", s.top_k == -1 or s.top_k >= 1, "must be -1 (disabled) or >= 1"),
        ("min_p", within("min_p", 0.0, 1.0), "must be in [0, 1]"),
        ("frequency_penalty", within("frequency_penalty", -2.0, 2.0), "must be in [-2, 2]"),
        ("presence_penalty", within("presence_penalty", -2.0, 2.0), "must be in [-2, 2]"),
        (
            "repetition_penalty",
            within("repetition_penalty", MIN_REPETITION_PENALTY, 2.0),
            f"must be in [{MIN_REPETITION_PENALTY:g}, 2]",
        ),
    ]
    for key, ok, rule in checks:
        if not ok:
            sent = raw.get(key, getattr(s, key))
            raise ValidationError(f"{prefix}{key} {rule}, got {sent}", prefix + key)


def _read_stop(raw: dict, param: str) -> list[str]:
    value = raw.get("stop")
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValidationError(f"{param} must be a string or a list of strings", param)
    if any(s == "" for s in stops):
        raise ValidationError(f"{param} must not contain an empty string", param)
    return stops


def _read_ids(raw: dict, key: str, param: str) -> list[int]:
    value = raw.get(key)
    if value is None:
        return []
    if not is_id_list(value):
        raise ValidationError(f"{param} must be a list of integers", param)
    return value


def _check_vocab(ids: list[int], limits: Limits, param: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < limits.vocab_size):
        return
    bad = [i for i in ids if i < 0 or i >= limits.vocab_size]
    if bad:
        raise ValidationError(
            f"{param} holds token id {bad[0]}, outside the vocabulary [0, {limits.vocab_size})",
            param,
        )


# --------------------------------------------------------------------------------------------
# Native /generate bodies


GENERATE_FIELDS = ("text", "input_ids", "sampling_params", "stream", "return_logprob", "rid")


def reject_unknown_fields(body: dict[str, Any], known: tuple[str, ...] | frozenset[str]) -> None:
    """A field the API does not know is an error, not silently ignored (a caller would believe
    it took effect)."""
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        name = unknown[0][:64]
        raise ValidationError(f"unrecognized request argument {name!r}", name)


def parse_generate_body(body: dict[str, Any], max_batch_size: int = 64) -> GenerateBody:
    """Split a /generate body into items (one per prompt); shapes and types are checked."""
    reject_unknown_fields(body, GENERATE_FIELDS)
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and input_ids is not None:
        raise ValidationError("send either text or input_ids, not both", "text")
    if text is None and input_ids is None:
        raise ValidationError("the body needs text or input_ids", "text")
    prompts, is_batch = _read_prompts(text, input_ids)
    if len(prompts) > max_batch_size:
        param = "text" if text is not None else "input_ids"
        raise ValidationError(
            f"a batch holds at most {max_batch_size} prompts (--max-batch-size), "
            f"got {len(prompts)}",
            param,
        )
    sampling = body.get("sampling_params")
    samplings = _per_item(sampling, len(prompts), is_batch, "sampling_params", dict)
    rids = _per_item(body.get("rid"), len(prompts), is_batch, "rid", str)
    stream = read_bool(body, "stream", False)
    return_logprob = read_bool(body, "return_logprob", False)
    rows = zip(prompts, samplings, rids, strict=True)
    items = [GenerateItem(p, s or {}, r) for p, s, r in rows]
    return GenerateBody(items, is_batch, stream, return_logprob)


def _read_prompts(text: Any, input_ids: Any) -> tuple[list[str | list[int]], bool]:
    if text is not None:
        if isinstance(text, str):
            return [_nonempty_text(text, "text")], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return [_nonempty_text(t, f"text[{i}]") for i, t in enumerate(text)], True
        raise ValidationError("text must be a non-empty string or a list of strings", "text")
    if is_id_list(input_ids):
        return [input_ids], False
    if isinstance(input_ids, list) and input_ids and all(is_id_list(x) for x in input_ids):
        return list(input_ids), True
    raise ValidationError(
        "input_ids must be a list of integers or a list of such lists", "input_ids"
    )


def _nonempty_text(text: str, param: str) -> str:
    if not text:
        raise ValidationError(f"{param} is empty; send a non-empty prompt", param)
    return text


def _per_item(value: Any, n: int, is_batch: bool, key: str, kind: type) -> list[Any]:
    if value is None:
        return [None] * n
    if isinstance(value, kind):
        if key == "rid" and is_batch:
            raise ValidationError("rid must be a list with one rid per prompt in a batch", key)
        return [value] * n
    if is_batch and isinstance(value, list) and all(isinstance(v, kind) for v in value):
        if len(value) != n:
            raise ValidationError(f"{key} has {len(value)} entries for {n} prompts", key)
        return list(value)
    expected = "an object" if kind is dict else "a string"
    raise ValidationError(f"{key} must be {expected} (or a list of them for a batch)", key)
