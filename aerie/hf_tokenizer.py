"""Loading a model directory's Hugging Face tokenizer, for the tokenizer and detokenizer processes.

`AutoTokenizer` imports torch, seconds of CPU at every start of processes that never run a
tensor. Where tokenizer_config.json names the generic fast tokenizer and the model type is one
checked to get that very class from `AutoTokenizer` (tests/aerie/test_hf_tokenizer.py), it is
loaded directly, without torch; everything else goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
import os

GENERIC_FAST_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
DIRECT_MODEL_TYPES = (None, "llama", "qwen3")  # None: no config.json or no model_type in it


def _json_field(path: str, name: str, field: str) -> str | None:
    try:
        with open(os.path.join(path, name)) as f:
            return json.load(f).get(field)
    except (OSError, ValueError, AttributeError):
        return None


def tokenizer_class_name(path: str) -> str | None:
    """The tokenizer_class of path/tokenizer_config.json (None: no file or no name)."""
    return _json_field(path, "tokenizer_config.json", "tokenizer_class")


def loads_directly(path: str) -> bool:
    """Whether `load_hf_tokenizer` skips `AutoTokenizer` for this directory."""
    return (
        tokenizer_class_name(path) in GENERIC_FAST_CLASSES
        and _json_field(path, "config.json", "model_type") in DIRECT_MODEL_TYPES
        and os.path.isfile(os.path.join(path, "tokenizer.json"))
    )


def load_hf_tokenizer(path: str):
    """The tokenizer `AutoTokenizer.from_pretrained(path)` gives, without importing torch where
    `loads_directly`."""
    if loads_directly(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
