"""The tokenizer and detokenizer processes load a model's tokenizer without importing torch
where the directory names the generic fast tokenizer, and get what AutoTokenizer gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from aerie.hf_tokenizer import load_hf_tokenizer, loads_directly, tokenizer_class_name
from tests.tokenizer_fixture import make_tiny_tokenizer

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "Hello, world!",
    "  two  spaces\nand a newline",
    "héllo ünïcode ✓",
    "<|im_start|>x",
    "cafe\u0301",
]


def test_the_process_modules_import_no_torch():
    code = (
        "import sys, tokenizer_proc.process; "
        "heavy = ('torch', 'transformers.models.auto'); "
        "print(sorted(m for m in heavy if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "[]"


def write_model_type(path: str, model_type: str | None) -> None:
    if model_type is not None:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"model_type": model_type}, f)


@pytest.mark.parametrize("model_type", [None, "llama", "qwen3"])
def test_the_generic_fast_tokenizer_loads_as_autotokenizer_would(tmp_path, model_type):
    path = make_tiny_tokenizer(tmp_path / "tok")
    write_model_type(path, model_type)
    assert tokenizer_class_name(path) in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert loads_directly(path)
    code = (
        "import sys; from aerie.hf_tokenizer import load_hf_tokenizer; "
        f"load_hf_tokenizer({path!r}); print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.stdout.strip() == "False"
    got, want = load_hf_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert type(got) is type(want) and len(got) == len(want)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text)
        assert got.decode(got.encode(text)) == want.decode(want.encode(text))
    chat = [{"role": "user", "content": "hi"}]
    assert got.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        want.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    )


def test_a_model_type_with_its_own_tokenizer_class_goes_through_autotokenizer(tmp_path):
    """transformers builds Qwen2Tokenizer (its own normalizer) for qwen2 even where the
    generic class is named: the direct load would differ, so it is not taken."""
    path = make_tiny_tokenizer(tmp_path / "tok")
    write_model_type(path, "qwen2")
    assert not loads_directly(path)
    assert type(load_hf_tokenizer(path)) is type(AutoTokenizer.from_pretrained(path))


@pytest.mark.parametrize("config", [None, {}, {"tokenizer_class": "SomeModelTokenizer"}])
def test_other_directories_go_through_autotokenizer(tmp_path, monkeypatch, config):
    """No tokenizer_config.json, no class named, or a model-specific class: AutoTokenizer."""
    path = make_tiny_tokenizer(tmp_path / "tok")
    config_path = os.path.join(path, "tokenizer_config.json")
    if config is None:
        os.remove(config_path)
    else:
        with open(config_path, "w") as f:
            json.dump(config, f)
    calls = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda p: calls.append(p) or "auto")
    assert load_hf_tokenizer(path) == "auto" and calls == [path]
