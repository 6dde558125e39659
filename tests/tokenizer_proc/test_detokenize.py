from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from aerie.messages import FinishReason
from tokenizer_proc.detokenize import DetokenizeSettings, IncrementalDetokenizer

TEXTS = (
    "héllo 世界 🙂 日本語 🚀✨ naïve café — Straße!",
    "Hello world! The quick brown fox jumps over the lazy dog.\n\ndef main():\n    return 0",
    "<|im_start|>assistant\n世界 🙂<|im_end|> 🚀 after the end<|endoftext|>",
)
LENGTH = FinishReason(type="length")


def make_start(stream=True, skip=True, stop=(), prompt_tail=()) -> DetokenizeSettings:
    return DetokenizeSettings(
        skip_special_tokens=skip, stop=tuple(stop), stream=stream, prompt_tail=tuple(prompt_tail)
    )


def split_chunks(ids: list[int], rng: random.Random | None) -> list[list[int]]:
    """One id per chunk without rng, else random chunk sizes 1..5."""
    chunks, i = [], 0
    while i < len(ids):
        size = rng.randint(1, 5) if rng else 1
        chunks.append(ids[i : i + size])
        i += size
    return chunks


def run(detok, chunks, finish=LENGTH) -> list[str]:
    """Feed every chunk, the last one with `finish`; returns the deltas."""
    return [
        detok.step(chunk, finish if i == len(chunks) - 1 else None)
        for i, chunk in enumerate(chunks)
    ]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", [None, 0, 1, 2])
def test_deltas_concatenate_to_full_decode(tokenizer, text, skip, seed):
    ids = tokenizer.encode(text)
    prompt_tail = tokenizer.encode("User said: 世")[-3:]
    detok = IncrementalDetokenizer(tokenizer, make_start(skip=skip, prompt_tail=prompt_tail))
    deltas = run(detok, split_chunks(ids, random.Random(seed) if seed is not None else None))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in delta for delta in deltas)
    assert sum(1 for delta in deltas if delta) > 3  # text streams out, not only at the end


def test_long_output_with_dropped_decode_history(tokenizer):
    text = "".join(TEXTS[:2]) * 12
    ids = tokenizer.encode(text)
    assert len(ids) > 600  # precondition: past the point where old ids are dropped
    detok = IncrementalDetokenizer(tokenizer, make_start())
    deltas = run(detok, split_chunks(ids, random.Random(5)))
    assert "".join(deltas) == text
    assert len(detok.ids) < 300


def test_multibyte_characters_split_over_tokens_wait_for_completion(tokenizer):
    ids = tokenizer.encode("🚀")
    assert len(ids) > 1  # precondition: the rocket is split into byte tokens
    detok = IncrementalDetokenizer(tokenizer, make_start())
    assert [detok.step([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.step(ids[-1:]) == "🚀"


def test_skip_special_tokens_hides_chatml_markers(tokenizer):
    ids = tokenizer.encode("<|im_start|>hi<|im_end|>")
    shown = "".join(
        run(IncrementalDetokenizer(tokenizer, make_start(skip=True)), [[i] for i in ids])
    )
    kept = "".join(
        run(IncrementalDetokenizer(tokenizer, make_start(skip=False)), [[i] for i in ids])
    )
    assert shown == "hi"
    assert kept == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("skip", [True, False])
def test_eos_stop_token_is_not_shown(tokenizer, stream, skip):
    ids = tokenizer.encode("The answer is 42.") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, make_start(stream=stream, skip=skip))
    finish = FinishReason(type="stop", matched=tokenizer.eos_token_id)
    assert "".join(run(detok, [[i] for i in ids], finish)) == "The answer is 42."


def test_non_special_stop_token_is_not_shown(tokenizer):
    ids = tokenizer.encode("The answer is 42.")
    detok = IncrementalDetokenizer(tokenizer, make_start())
    finish = FinishReason(type="stop", matched=ids[-1])  # "." as a stop_token_id
    assert "".join(run(detok, [[i] for i in ids], finish)) == "The answer is 42"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("seed", [None, 3])
def test_stop_string_trims_and_is_never_shown(tokenizer, stream, seed):
    full = "The answer is 42. Stop here. END of the story."
    stop = "Stop here"
    ids = tokenizer.encode(full)
    # The scheduler truncates the outputs right after the token that completes the stop string.
    cut = next(n for n in range(len(ids)) if stop in tokenizer.decode(ids[:n]))
    ids = ids[:cut]
    assert len(tokenizer.encode(" " + stop)) > 2  # precondition: it spans several tokens
    detok = IncrementalDetokenizer(tokenizer, make_start(stream=stream, stop=["zzz", stop]))
    chunks = split_chunks(ids, random.Random(seed) if seed is not None else None)
    deltas = run(detok, chunks, FinishReason(type="stop", matched=stop))
    assert "".join(deltas) == "The answer is 42. "
    assert not any(delta.endswith("S") or "St" in delta for delta in deltas)


def test_stop_string_prefix_is_held_back_then_released(tokenizer):
    text = "The answer is 42. Stop here. END"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, make_start(stop=["Stop now"]))
    shown = ""
    for n, token_id in enumerate(ids):
        shown += detok.step([token_id])
        decoded = tokenizer.decode(ids[: n + 1])
        assert decoded.startswith(shown)
        held = decoded[len(shown) :]
        if decoded.endswith(("S", "St", "Sto", "Stop", "Stop ", "Stop n")):
            assert held and "Stop now".startswith(held)  # a possible stop string start waits
        else:
            assert held == ""  # anything else is shown at once (no partial characters here)
    assert shown == text  # "Stop h" could not start "Stop now": released before the finish
    assert detok.step([], LENGTH) == ""


def test_held_back_prefix_is_flushed_at_finish(tokenizer):
    ids = tokenizer.encode("The answer is 42. Sto")
    detok = IncrementalDetokenizer(tokenizer, make_start(stop=["Stop"]))
    shown = "".join(detok.step([i]) for i in ids)
    assert shown == "The answer is 42. "
    assert detok.step([], LENGTH) == "Sto"


def test_non_streaming_decodes_once_at_finish(tokenizer):
    ids = tokenizer.encode(TEXTS[0])
    calls = []

    class CountingTokenizer:
        def decode(self, ids, **kwargs):
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    detok = IncrementalDetokenizer(CountingTokenizer(), make_start(stream=False))
    deltas = run(detok, [[i] for i in ids])
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == TEXTS[0]
    assert len(calls) == 2


def test_step_after_finish_raises(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, make_start())
    detok.step(tokenizer.encode("hi"), LENGTH)
    with pytest.raises(RuntimeError):
        detok.step([1])


def make_metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: its decoder drops the leading space of a sequence."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"], show_progress=False)
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_spaces_between_tokens_with_a_metaspace_decoder():
    tokenizer = make_metaspace_tokenizer()
    prompt = tokenizer.encode("the quick")
    ids = tokenizer.encode("the quick brown fox jumps")[len(prompt) :]
    assert tokenizer.decode(ids[:1]) == tokenizer.decode(ids[:1]).lstrip()  # drops lead space
    detok = IncrementalDetokenizer(tokenizer, make_start(prompt_tail=prompt))
    assert "".join(run(detok, [[i] for i in ids])) == " brown fox jumps"


def test_the_direct_decoder_is_the_tokenizers_decode(tokenizer):
    """The generic fast tokenizer's decode goes straight to the `tokenizers` library and gives
    what `decode(..., clean_up_tokenization_spaces=False)` gives, special ids and split
    characters included; a tokenizer class with a decode of its own keeps it."""
    import random

    from tokenizer_proc.detokenize import make_decoder

    decoder = make_decoder(tokenizer)
    assert decoder.__name__ == "decode_directly"
    special = list(tokenizer.all_special_ids)
    rng = random.Random(0)
    for _ in range(200):
        ids = [
            rng.choice(special) if rng.random() < 0.15 else rng.randrange(len(tokenizer))
            for _ in range(rng.randrange(0, 12))
        ]
        for skip in (True, False):
            expected = tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
            )
            assert decoder(ids, skip) == expected

    class OwnDecode(type(tokenizer)):
        def decode(self, ids, **kwargs):  # noqa: ANN001, ANN003
            return "own"

    tokenizer.__class__, original = OwnDecode, type(tokenizer)
    try:
        assert make_decoder(tokenizer)([5], True) == "own"
    finally:
        tokenizer.__class__ = original
