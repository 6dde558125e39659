from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.tokenizer_fixture import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)
