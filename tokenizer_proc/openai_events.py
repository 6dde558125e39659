"""The SSE events of an OpenAI stream (/v1/completions, /v1/chat/completions) as UTF-8 bytes.

`OpenAIEvents` writes each chunk from byte templates made once per request, so an event costs
the escaping of its text and logprobs. The bytes must equal `sse(chunk_dict)` of `openai_api`'s
dicts (same key order and separators): the tests hold the two to the same bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from json.encoder import encode_basestring  # type: ignore[attr-defined]

from tokenizer_proc.openai_request import OpenAIRequest
from tokenizer_proc.request_tracker import Chunk, RequestState
from tokenizer_proc.responses import json_text, number_json

CHAT_ROLE_CHOICE = (
    b'{"index": 0, "delta": {"role": "assistant", "content": ""}, '
    b'"logprobs": null, "finish_reason": null}'
)


class OpenAIEvents:
    """`data: ...` events of one streamed request, in the order `stream_openai` sends them.

    Each event's `created` is read from the clock when the event is written, as the envelope
    did for every chunk; the head of the envelope is rebuilt only when that second changes.
    `content` keeps the completions `text_offset` of the next chunk (the characters sent so
    far), which the logprobs of a completion chunk count from.
    """

    def __init__(
        self,
        req: OpenAIRequest,
        state: RequestState,
        token_strings: Callable[[list[int]], list[str]],
    ) -> None:
        self.req, self.state, self.token_strings = req, state, token_strings
        chat = req.kind == "chat"
        rid = ("chatcmpl-" if chat else "cmpl-") + state.rid
        obj = req.object_prefix + (".chunk" if chat else "")
        self._id_object = f'data: {{"id": {json_text(rid)}, "object": {json_text(obj)}, '.encode()
        self._model = f', "model": {json_text(req.model)}, "choices": ['.encode()
        self._tail = b'], "usage": null}\n\n' if req.include_usage else b"]}\n\n"
        if chat:
            self._text_open = b', "finish_reason": null, "delta": {"content": "'
            self._text_close = b'"}}'
        else:
            self._text_open, self._text_close = b', "finish_reason": null, "text": "', b'"}'
        self._created = -1  # the second self._head was made in
        self._head = b""
        self.text_offset = 0

    def head(self) -> bytes:
        """`data: {"id": ..., "object": ..., "created": <now>, "model": ..., "choices": [`."""
        created = int(time.time())
        if created != self._created:
            self._created = created
            self._head = b'%b"created": %d%b' % (self._id_object, created, self._model)
        return self._head

    def role(self) -> bytes:
        """The chat stream's first event: the assistant role with empty content."""
        return b"".join((self.head(), CHAT_ROLE_CHOICE, self._tail))

    def content(self, chunk: Chunk) -> bytes:
        """The event of a chunk with text or tokens (finish_reason is sent on its own)."""
        text = encode_basestring(chunk.text)[1:-1].encode()
        logprobs = self._logprobs(chunk) if self.req.logprobs else b"null"
        self.text_offset += len(chunk.text)
        parts = (
            self.head(),
            b'{"index": 0, "logprobs": ',
            logprobs,
            self._text_open,
            text,
            self._text_close,
            self._tail,
        )
        return b"".join(parts)

    def finish(self) -> bytes:
        """The event that carries finish_reason, with empty text (delta)."""
        finish = self.state.finish
        reason = json_text(finish.type if finish is not None else None).encode()
        empty = b'"delta": {}' if self.req.kind == "chat" else b'"text": ""'
        choice = b'{"index": 0, "logprobs": null, "finish_reason": %b, %b}' % (reason, empty)
        return b"".join((self.head(), choice, self._tail))

    def usage(self) -> bytes:
        """The include_usage event: no choices, the request's token counts."""
        prompt, completion = self.state.prompt_tokens, self.state.completion_tokens
        usage = (
            b'{"prompt_tokens": %d, "completion_tokens": %d, "total_tokens": %d, '
            b'"prompt_tokens_details": {"cached_tokens": %d}}'
            % (prompt, completion, prompt + completion, self.state.cached_tokens)
        )
        return b'%b], "usage": %b}\n\n' % (self.head(), usage)

    def _logprobs(self, chunk: Chunk) -> bytes:
        tokens = self.token_strings(chunk.output_ids)
        if self.req.kind == "chat":
            return chat_logprobs(tokens, chunk.logprobs, bool(self.req.top_logprobs))
        return completion_logprobs(
            tokens, chunk.logprobs, bool(self.req.top_logprobs), self.text_offset
        )


def chat_logprobs(tokens: list[str], logprobs: list[float], top: bool) -> bytes:
    """The chat chunk's `logprobs` object: one entry per (token, logprob) pair; each entry's
    `top_logprobs` repeats it (the sampled token only) when top is set, else is empty."""
    entries = []
    for token, logprob in zip(tokens, logprobs, strict=False):
        entry = (
            f'"token": {encode_basestring(token)}, "logprob": {number_json(logprob)}, '
            f'"bytes": [{", ".join(map(str, token.encode()))}]'
        )
        entries.append(
            f'{{{entry}, "top_logprobs": [{{{entry}}}]}}'
            if top
            else f'{{{entry}, "top_logprobs": []}}'
        )
    return f'{{"content": [{", ".join(entries)}]}}'.encode()


def completion_logprobs(tokens: list[str], logprobs: list[float], top: bool, offset: int) -> bytes:
    """The completion chunk's `logprobs` object; text_offset counts on from offset."""
    names = [encode_basestring(token) for token in tokens]
    values = [number_json(logprob) for logprob in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(str(offset))
        offset += len(token)
    top_json = "null"
    if top:
        pairs = [f"{{{name}: {value}}}" for name, value in zip(names, values, strict=False)]
        top_json = f"[{', '.join(pairs)}]"
    return (
        f'{{"tokens": [{", ".join(names)}], "token_logprobs": [{", ".join(values)}], '
        f'"top_logprobs": {top_json}, "text_offset": [{", ".join(offsets)}]}}'
    ).encode()
