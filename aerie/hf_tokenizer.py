"""Loading a model directory's Hugging Face tokenizer, for the tokenizer and detokenizer
processes.

`AutoTokenizer` imports torch (through the model configuration classes it may need to pick a
tokenizer class): about 3.5 s of CPU in each of those two processes, at every start, though
neither runs a tensor. When tokenizer_config.json names the generic fast tokenizer (the class
`AutoTokenizer` would build from tokenizer.json anyway), it is loaded directly, which imports
no torch (0.15 s for the default model). Any other class, or no tokenizer_config.json, goes
through `AutoTokenizer` as before.
"""

from __future__ import annotations

import json
import os

GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_class_name(path: str) -> str | None:
    """The tokenizer_class of path/tokenizer_config.json (None: no file or no name)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            return json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_hf_tokenizer(path: str):
    """The tokenizer `AutoTokenizer.from_pretrained(path)` gives, without importing torch where
    the directory names the generic fast tokenizer."""
    if tokenizer_class_name(path) in GENERIC_FAST_CLASSES and os.path.isfile(
        os.path.join(path, "tokenizer.json")
    ):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
