"""Text <-> token ids for the frontend: a thin wrapper over a Hugging Face tokenizer.

`Tokenizer.encode` tokenizes a prompt (with the tokenizer's own special tokens, e.g. BOS);
`encode_chat` renders the chat template with `add_generation_prompt=True` and tokenizes the
result without adding special tokens again; `decode` turns ids back into text without special
tokens. `vocab_size` is the largest id range the model can take: max(len(tokenizer), the model
config's vocab_size).
"""

from __future__ import annotations

import os
from typing import Any

from aerie.config import AerieConfig
from aerie.hf_tokenizer import load_hf_tokenizer
from aerie.model_info import read_model_info


class Tokenizer:
    def __init__(self, path: str, model_vocab_size: int = 0) -> None:
        self.path = path
        self._tok = load_hf_tokenizer(path)
        self.vocab_size = max(len(self._tok), model_vocab_size)
        self.max_token_bytes = self._longest_token_bytes()
        self._warm_up()

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

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of the chat template applied to messages, ready for generation."""
        if not getattr(self._tok, "chat_template", None):
            raise ValueError(f"the tokenizer at {self.path!r} has no chat template")
        prompt = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self._tok.encode(prompt, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """The text of ids without special tokens (an assistant turn to put back into a
        conversation)."""
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded on its own (for OpenAI logprobs' `token` fields)."""
        return [self._tok.decode([i]) for i in ids]
