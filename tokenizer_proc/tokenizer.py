"""Text <-> token ids for the frontend: a thin wrapper over a Hugging Face tokenizer, and the
per-request detokenizers that turn output ids back into text.

`encode_chat` tokenizes message content as text, so a special token's string in it cannot forge
a turn; `vocab_size` is max(len(tokenizer), the model config's vocab_size).
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

from aerie.config import AerieConfig
from aerie.hf_tokenizer import load_hf_tokenizer
from aerie.messages import SamplingParams
from aerie.model_info import read_model_info
from tokenizer_proc.detokenize import (
    PROMPT_TAIL_LEN,
    DetokenizeSettings,
    IncrementalDetokenizer,
    make_decoder,
)

# While the template renders, a special token's string in message content stands as ESCAPE and
# a code character (ESCAPE itself as two), which no tokenizer matches as a special token.
ESCAPE = "\U0010fffd"  # a private-use character
_ESCAPED = re.compile(f"{ESCAPE}(.)", re.DOTALL)
_EMPTY = [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}]


class Tokenizer:
    def __init__(self, path: str, model_vocab_size: int = 0) -> None:
        self.path = path
        self._tok = load_hf_tokenizer(path)
        self._decoder = make_decoder(self._tok)
        self.vocab_size = max(len(self._tok), model_vocab_size)
        self.max_token_bytes = self._longest_token_bytes()
        self._special = {
            token.content: i for i, token in self._tok.added_tokens_decoder.items() if token.special
        }
        longest_first = sorted(self._special, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
        self._to_escape = re.compile("|".join([*map(re.escape, longest_first), ESCAPE]))
        codes = [ESCAPE, *(chr(0xF0000 + i) for i in range(len(longest_first)))]
        self._code_of = dict(zip([ESCAPE, *longest_first], codes, strict=True))
        self._text_of = {code: text for text, code in self._code_of.items()}
        self._warm_up()
        self.chat_tokens_per_message = self._chat_tokens_per_message()

    def detokenizer(
        self, sampling: SamplingParams, stream: bool, prompt_ids: list[int]
    ) -> IncrementalDetokenizer:
        """A request's incremental detokenizer (its text, stop strings trimmed)."""
        settings = DetokenizeSettings(
            skip_special_tokens=sampling.skip_special_tokens,
            stop=tuple(sampling.stop),
            stream=stream,
            prompt_tail=tuple(prompt_ids[-PROMPT_TAIL_LEN:]),
        )
        return IncrementalDetokenizer(self._tok, settings, self._decoder)

    def _longest_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text (a byte piece of a character decodes to
        U+FFFD, 3 bytes: an overestimate, which keeps the byte pre-check safe)."""
        texts = self._tok.batch_decode([[i] for i in range(len(self._tok))])
        return max((len(t.encode("utf-8", "replace")) for t in texts), default=1) or 1

    def _warm_up(self) -> None:
        """Encode once and render the chat template once now, so the first request does not
        pay for lazy set-up (the template compiles on first use) on the event loop."""
        self.encode("warm up")
        if getattr(self._tok, "chat_template", None):
            try:
                self.encode_chat([{"role": "user", "content": "warm up"}])
            except Exception:  # noqa: BLE001 - a template that needs other roles still compiled
                pass

    @classmethod
    def from_config(cls, config: AerieConfig) -> Tokenizer:
        """The tokenizer of a resolved config's tokenizer_path."""
        path = config.model.tokenizer_path
        if not path:
            raise ValueError("config.model.tokenizer_path is not resolved")
        model_vocab = 0
        model_path = config.model.model_path
        if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
            model_vocab = read_model_info(model_path).vocab_size
        return cls(path, model_vocab)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the chat template applied to messages, ready for generation; message
        content is tokenized as text (see the module docstring). Without special tokens in
        content, exactly the tokens of the rendered prompt. Raises ValueError without a chat
        template, jinja2.TemplateError for messages the template refuses."""
        if not self.has_chat_template:
            raise ValueError("the tokenizer has no chat template")
        escaped = [{**m, "content": self._escape(m["content"])} for m in messages]
        prompt = self._tok.apply_chat_template(escaped, tokenize=False, add_generation_prompt=True)
        if ESCAPE not in prompt:
            return list(self._tok.encode(prompt, add_special_tokens=False))
        # As the tokenizer would, split at special tokens (here only the template's) and
        # tokenize the text between them, content's escaped strings restored as plain text.
        ids: list[int] = []
        start = 0
        for match in self._special_re.finditer(prompt):
            ids += self._encode_content(prompt[start : match.start()])
            ids.append(self._special[match.group()])
            start = match.end()
        return ids + self._encode_content(prompt[start:])

    def _escape(self, text: str) -> str:
        return self._to_escape.sub(lambda m: ESCAPE + self._code_of[m.group()], text)

    def _encode_content(self, text: str) -> list[int]:
        """Ids of a piece of the rendered prompt between special tokens, escapes restored."""
        text = _ESCAPED.sub(lambda m: self._text_of.get(m.group(1), m.group()), text)
        return self._encode_text(text) if text else []

    @functools.cached_property
    def _encode_text(self) -> Callable[[str], list[int]]:
        """Token ids of a text with every special token's string taken as characters. A copy
        of the fast backend does it (switching the shared one would race with the other
        tokenizing thread), made on first use (0.3 s for the default model); a slow tokenizer
        takes it as an argument."""
        backend = getattr(self._tok, "backend_tokenizer", None)
        if backend is None:
            return lambda text: self._tok.encode(
                text, add_special_tokens=False, split_special_tokens=True
            )
        from tokenizers import Tokenizer as Backend

        text_backend = Backend.from_str(backend.to_str())
        text_backend.encode_special_tokens = True
        return lambda text: text_backend.encode(text, add_special_tokens=False).ids

    def _chat_tokens_per_message(self) -> int:
        """A lower bound on the tokens the chat template adds for each message (for the size
        check before tokenizing): what an empty user and assistant turn add, halved, less 2
        for tokens that content can share with the template at its two ends; at least 1."""
        if not self.has_chat_template:
            return 1
        try:
            one = len(self.encode_chat(_EMPTY[:1]))
            three = len(self.encode_chat([*_EMPTY, _EMPTY[0]]))
        except Exception:  # noqa: BLE001 - a template that refuses empty turns: no bound known
            return 1
        return max(1, (three - one) // 2 - 2)

    def decode(self, ids: list[int]) -> str:
        """The text of ids without special tokens (an assistant turn to put back into a
        conversation)."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (for OpenAI logprobs' `token` fields)."""
        return [self._tok.decode([i]) for i in ids]
