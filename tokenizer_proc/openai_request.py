"""Parse and check an OpenAI completions or chat request into a tokenized native request.

Only what Aerie implements is accepted: a parameter it does not implement (`tools`,
`response_format`, ...) or an unknown field is a 400 naming it, so a caller never believes
JSON mode or tool calling took effect (`docs/serving.md`, "The HTTP APIs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizer_proc.frontend import Frontend, Prepared
from tokenizer_proc.validation import (
    ValidationError,
    is_id_list,
    kind_of,
    max_chat_messages,
    read_bool,
    read_int,
    read_str,
    reject_unknown_fields,
)

_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
)
_ROLES = ("system", "user", "assistant", "developer")
_COMMON_FIELDS = (
    "model",
    "max_tokens",
    "n",
    "stream",
    "stream_options",
    "logprobs",
    "user",
    *_PASSTHROUGH,
)
FIELDS = {
    "completion": frozenset((*_COMMON_FIELDS, "prompt", "echo")),
    "chat": frozenset((*_COMMON_FIELDS, "messages", "max_completion_tokens", "top_logprobs")),
}
# OpenAI parameters Aerie does not implement: refused by name unless empty or off.
UNSUPPORTED = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "response_format",
    "logit_bias",
    "best_of",
    "suffix",
    "audio",
    "modalities",
    "prediction",
    "reasoning_effort",
    "web_search_options",
    "store",
    "metadata",
    "service_tier",
)

_KNOWN = {kind: fields | frozenset(UNSUPPORTED) for kind, fields in FIELDS.items()}


def check_fields(body: dict[str, Any], kind: str) -> None:
    """400 for a parameter Aerie does not implement, then for any unknown field."""
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, [], {}):
            raise ValidationError(f"{name} is not supported by this server", name)
    reject_unknown_fields(body, _KNOWN[kind])


DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class OpenAIRequest:
    kind: str  # "completion" | "chat"
    prepared: Prepared
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int

    @property
    def object_prefix(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


# ----------------------------------------------------------------------------------------------
# Parsing


async def parse_openai(frontend: Frontend, body: dict[str, Any], kind: str) -> OpenAIRequest:
    """Validate and tokenize a completions (kind="completion") or chat body."""
    check_fields(body, kind)
    n = read_int(body, "n", 1)
    if n != 1:
        raise ValidationError(f"n > 1 is not supported (got n={n}); send n requests", "n")
    if read_bool(body, "echo", False):
        raise ValidationError("echo is not supported", "echo")
    read_str(body, "model")  # any name is served by the one model; responses name it
    model = frontend.model_name
    if kind == "chat":
        limit = max_chat_messages(frontend.tokenizer.chat_tokens_per_message, frontend.limits)
        ids = await frontend.encode_chat(read_messages(body, limit))
        logprobs = read_bool(body, "logprobs", False)
        top_logprobs = read_int(body, "top_logprobs", 0) or 0
        if not 0 <= top_logprobs <= 20:
            raise ValidationError("top_logprobs must be in [0, 20]", "top_logprobs")
    else:
        ids = await read_completion_prompt(frontend, body)
        top_logprobs = read_int(body, "logprobs", None)  # type: ignore[assignment]
        logprobs = top_logprobs is not None
        if logprobs and not 0 <= top_logprobs <= 5:
            raise ValidationError("logprobs must be in [0, 5]", "logprobs")
        top_logprobs = top_logprobs or 0
    sampling = map_sampling(body, kind, frontend.limits.context_length - len(ids))
    try:
        prepared = await frontend.prepare(ids, sampling, None, "prompt", prefix="")
    except ValidationError as e:
        if e.param == "max_new_tokens":
            message = e.message.replace("max_new_tokens", "max_tokens")
            raise ValidationError(message, "max_tokens") from None
        raise
    stream = read_bool(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ValidationError("stream_options must be an object", "stream_options")
    include_usage = read_bool(options, "include_usage", False, "stream_options.include_usage")
    return OpenAIRequest(kind, prepared, model, stream, include_usage, logprobs, top_logprobs)


def map_sampling(body: dict[str, Any], kind: str, room: int) -> dict[str, Any]:
    """Native-named sampling keys from an OpenAI body (defaults for max_tokens applied)."""
    sampling = {k: body[k] for k in _PASSTHROUGH if body.get(k) is not None}
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is None and room > 0:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, room) if kind == "completion" else room
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    return sampling


async def read_completion_prompt(frontend: Frontend, body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ValidationError("prompt is empty; send a non-empty prompt", "prompt")
        return await frontend.tokenize(prompt, "prompt")
    if is_id_list(prompt):
        return prompt  # type: ignore[return-value]
    if isinstance(prompt, list) and prompt:
        raise ValidationError("batched prompts are not supported; send one per request", "prompt")
    raise ValidationError("prompt must be a string or a list of token ids", "prompt")


def read_messages(body: dict[str, Any], max_messages: int) -> list[dict[str, str]]:
    """The messages as role and text content; more than max_messages (what the context can
    hold) are refused before any is looked at."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValidationError("messages must be a non-empty list", "messages")
    if len(messages) > max_messages:
        raise ValidationError(
            f"{len(messages)} messages cannot fit the context: at most {max_messages} can "
            "(each takes tokens of the chat template)",
            "messages",
        )
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise ValidationError(f"{param} needs a role, one of {', '.join(_ROLES)}", param)
        out.append({"role": m["role"], "content": read_content(m.get("content"), param)})
    return out


def read_content(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ValidationError(f"{param}: only text content parts are supported", param)
            text = part.get("text")
            if not isinstance(text, str):
                where = f"{param}.content[{i}].text"
                raise ValidationError(f"{where} must be a string, got {kind_of(text)}", where)
            parts.append(text)
        return "".join(parts)
    raise ValidationError(f"{param}.content must be a string or a list of parts", param)
