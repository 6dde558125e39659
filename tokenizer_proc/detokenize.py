"""Incremental detokenization of one request: token ids in, text deltas out (pure, no sockets).

A delta is decode(ids[surr:]) minus decode(ids[surr:read]), so spacing matches the
whole-sequence decode; a delta ending in U+FFFD (a split UTF-8 character) waits for more ids.
Invariant: the deltas concatenate to the final text (the output ids decoded, without a matched
stop token, cut before a matched stop string).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from aerie.messages import FinishReason
from tokenizer_proc.stop_strings import find_safe_end, trim_at_stop

_REPLACEMENT_CHAR = "\ufffd"
_MAX_DEAD_IDS = 256  # drop already-decoded ids from the front once this many pile up
PROMPT_TAIL_LEN = 5  # last prompt ids kept as decoding context for the first output token


@dataclass(frozen=True)
class DetokenizeSettings:
    """How one request's text is made: its sampling parameters' skip_special_tokens and stop
    strings, whether it streams, and the last prompt ids as decoding context."""

    skip_special_tokens: bool = True
    stop: tuple[str, ...] = ()
    stream: bool = True
    prompt_tail: tuple[int, ...] = ()


class IncrementalDetokenizer:
    """Turns one request's output ids into text deltas.

    `tokenizer` is a HF tokenizer (anything with `decode(ids, skip_special_tokens=...)`).
    Non-streaming requests decode only once, at finish: their deltas are empty until then.
    While streaming, memory is bounded by the decode window and the held-back text, not by
    the output length.
    """

    def __init__(
        self,
        tokenizer,
        settings: DetokenizeSettings,
        decoder: Callable[[list[int], bool], str] | None = None,
    ) -> None:
        """decoder: `make_decoder(tokenizer)`, when the caller has it already."""
        self.tokenizer = tokenizer
        self._decoder = decoder or make_decoder(tokenizer)
        self.skip_special_tokens = settings.skip_special_tokens
        self.stops = [stop for stop in settings.stop if stop]
        self.stream = settings.stream
        # The window starts in the prompt's tail, so the first output token gets the leading
        # space it would have after the prompt.
        self.ids: list[int] = list(settings.prompt_tail)  # context, then output ids
        self.surr_offset = 0
        self.read_offset = len(self.ids)
        self.unsent_text = ""  # decoded but not yet returned (held back or not yet asked for)
        self.finished = False

    def step(self, new_ids: list[int], finish: FinishReason | None = None) -> str:
        """Feed new output ids (and the finish reason, if this is the last delta).

        Returns the text to show now. After a finish, everything is flushed and the detokenizer
        must not be fed again. A stop token id (finish.matched is an int) at the end of new_ids
        is not decoded.
        """
        if self.finished:
            raise RuntimeError("IncrementalDetokenizer.step called after finish")
        self.ids.extend(drop_stop_token(new_ids, finish))
        if finish is not None:
            self.finished = True
            self.commit_pending(force=True)
            if finish.type == "stop" and isinstance(finish.matched, str):
                self.unsent_text = trim_at_stop(self.unsent_text, finish.matched)
            return self.take(len(self.unsent_text))
        if self.stream:
            self.commit_pending(force=False)
        return self.take(find_safe_end(self.unsent_text, self.stops))

    def commit_pending(self, force: bool) -> None:
        """Decode ids past read_offset into unsent_text unless they end mid-character.

        With force (at finish) an unfinished character is committed as U+FFFD.
        Mutates ids, the offsets and unsent_text.
        """
        if self.read_offset == len(self.ids):
            return
        surr_text = self.decode(self.ids[self.surr_offset : self.read_offset])
        read_text = self.decode(self.ids[self.surr_offset :])
        new_text = read_text[len(surr_text) :]
        if new_text.endswith(_REPLACEMENT_CHAR) and not force:
            return
        self.unsent_text += new_text
        if new_text:
            self.surr_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.surr_offset >= _MAX_DEAD_IDS:  # ids before surr_offset are never decoded again
            del self.ids[: self.surr_offset]
            self.read_offset -= self.surr_offset
            self.surr_offset = 0

    def take(self, num_chars: int) -> str:
        """Return and remove the first num_chars of unsent_text."""
        delta, self.unsent_text = self.unsent_text[:num_chars], self.unsent_text[num_chars:]
        return delta

    def decode(self, ids: list[int]) -> str:
        return self._decoder(ids, self.skip_special_tokens)


def make_decoder(tokenizer) -> Callable[[list[int], bool], str]:
    """(ids, skip_special_tokens) -> the tokenizer's decode of ids with tokenization-space
    cleanup off (" ." -> "." is not prefix-stable).

    For the generic fast tokenizer that decode is one call of the `tokenizers` library, which
    is made directly: transformers' own `decode` wraps it in argument conversions that cost
    four times the decode (two decodes per token per request, every step). A tokenizer class
    that overrides decode goes through its own."""
    from transformers import PreTrainedTokenizerFast

    backend = getattr(tokenizer, "backend_tokenizer", None)
    cls = type(tokenizer)
    if (
        backend is not None
        and cls.decode is PreTrainedTokenizerFast.decode
        and cls._decode is PreTrainedTokenizerFast._decode
    ):

        def decode_directly(ids: list[int], skip_special_tokens: bool) -> str:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)

        return decode_directly

    def decode(ids: list[int], skip_special_tokens: bool) -> str:
        return tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    return decode


def drop_stop_token(ids: list[int], finish: FinishReason | None) -> list[int]:
    """ids without a trailing stop token id (finish.matched an int): it is not shown as text."""
    if (
        finish is not None
        and finish.type == "stop"
        and isinstance(finish.matched, int)
        and not isinstance(finish.matched, bool)
        and ids
        and ids[-1] == finish.matched
    ):
        return ids[:-1]
    return ids
