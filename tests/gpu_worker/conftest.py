from __future__ import annotations

import pytest

from tests.gpu_worker.checkpoints import load_reference, make_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints by name: llama, llama_tied, qwen2, qwen3, llama_sharded, llama31."""

    def make(name: str, arch: str, **overrides) -> str:
        return make_tiny_checkpoint(str(tmp_path_factory.mktemp(name)), arch, **overrides)

    return {
        "llama": make("llama", "llama"),
        "llama_tied": make("llama_tied", "llama", tie_word_embeddings=True, seed=1),
        "qwen2": make("qwen2", "qwen2", seed=2),
        "qwen3": make("qwen3", "qwen3", head_dim=32, seed=3),
        "llama_sharded": make("llama_sharded", "llama", max_shard_size="40KB", seed=4),
        "llama31": make(
            "llama31",
            "llama",
            seed=5,
            rope_theta=10000.0,  # with head_dim 16: short, medium and long wavelengths
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
    }


@pytest.fixture(scope="session")
def reference_models(tiny_dirs):
    """HF models loaded from the tiny checkpoints (cached per session)."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_reference(tiny_dirs[name])
        return cache[name]

    return get
