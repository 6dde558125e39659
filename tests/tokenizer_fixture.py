"""A tiny real tokenizer for tests: byte-level BPE trained in-process, saved as a HF directory.

`make_tiny_tokenizer(dir)` trains a ByteLevel BPE (the scheme of Llama-3, Qwen and SmolLM2) on a
few sentences that include multi-byte characters ("héllo 世界 🙂"), so that some characters are
split across several tokens. It adds the ChatML special tokens and a ChatML chat template, and
saves with `save_pretrained`, so `AutoTokenizer.from_pretrained(dir)` loads it like a real model's.
Training takes a few milliseconds and is deterministic.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TRAINING_TEXT = (
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "héllo 世界 🙂 — café, naïve, señor, Straße.",
    "Speculative decoding drafts tokens and the target verifies them in one forward.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "The answer is 42. Stop here. END of the story.",
    "世界你好，今天天气很好。 🙂🙃 emoji time!",
)

VOCAB_SIZE = 320  # 256 bytes + 3 specials + merges: common pieces merge, rare chars stay split


def train_tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE `tokenizers.Tokenizer` trained on `TRAINING_TEXT`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    return tokenizer


def make_tiny_tokenizer(directory: str | os.PathLike) -> str:
    """Train, wrap in `PreTrainedTokenizerFast` and save to `directory`; returns the path.

    eos is <|im_end|> (as in ChatML instruct models), pad is <|endoftext|>; all three ChatML
    tokens are special (skipped by `skip_special_tokens=True`).
    """
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=train_tiny_tokenizer(),
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    wrapped.save_pretrained(path)
    return path
