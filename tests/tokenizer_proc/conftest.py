from __future__ import annotations

import pytest

from tests.tokenizer_fixture import make_tiny_tokenizer
from tests.tokenizer_proc.harness import LiveServer, make_frontend


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> str:
    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    """The tiny tokenizer as transformers loads it (the detokenizer's tests)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture
def live(tokenizer_dir):
    """(LiveServer, Frontend, FakeEngine) with the engine marked ready."""
    frontend, engine = make_frontend(tokenizer_dir)
    with LiveServer(frontend) as server:
        yield server, frontend, engine
