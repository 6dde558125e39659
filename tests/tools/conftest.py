from __future__ import annotations

import pytest

from tests.tokenizer_fixture import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))
