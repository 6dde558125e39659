"""Tokenizer wrapper: chat template with a generation prompt, vocab size."""

from __future__ import annotations

from transformers import AutoTokenizer

from tokenizer_proc.tokenizer import Tokenizer


def test_chat_template_ends_with_the_generation_prompt(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok.encode_chat([{"role": "user", "content": "Hello world"}])
    text = hf.decode(ids)
    assert text.startswith("<|im_start|>user\nHello world<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    assert ids.count(hf.convert_tokens_to_ids("<|im_start|>")) == 2  # no extra BOS


def test_encode_and_vocab_size(tokenizer_dir):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert Tokenizer(tokenizer_dir).encode("Hello world") == hf.encode("Hello world")
    assert Tokenizer(tokenizer_dir).vocab_size == len(hf)
    assert Tokenizer(tokenizer_dir, model_vocab_size=1000).vocab_size == 1000


def test_decode_drops_special_tokens(tokenizer_dir):
    """An answer put back into a conversation carries no end-of-turn token of its own."""
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok = Tokenizer(tokenizer_dir)
    ids = tok.encode("Hello world") + [hf.convert_tokens_to_ids("<|im_end|>")]
    assert "<|im_end|>" in hf.decode(ids)
    assert tok.decode(ids) == hf.decode(tok.encode("Hello world"))
