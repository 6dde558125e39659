"""Session fixtures for launched-server tests: model directories and a shared default server."""

from __future__ import annotations

import pytest

from tests.e2e.server import Server
from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.tokenizer_fixture import make_tiny_tokenizer

TINY_VOCAB = 384  # > the tiny tokenizer's 320 ids


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    """Random tiny Llama / Qwen2 / Qwen3 checkpoints, each with the tiny byte-level tokenizer."""
    dirs = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        make_tiny_checkpoint(path, arch, vocab_size=TINY_VOCAB, max_position_embeddings=512)
        make_tiny_tokenizer(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory) -> str:
    """A tiny Llama whose requests may decode for seconds (4,096 positions): the 512 of the
    others take well under a second on CPU, which signal handling on a loaded machine can
    outlast."""
    path = str(tmp_path_factory.mktemp("tiny-long"))
    make_tiny_checkpoint(path, "llama", vocab_size=TINY_VOCAB, max_position_embeddings=4096)
    make_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    from aerie.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def default_server(default_model_dir):
    """One server on the default model (no --model-path), shared by the API tests."""
    with Server("--chunked-prefill-size", "64", "--max-running-requests", "16") as server:
        yield server
