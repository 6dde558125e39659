"""Tiny random HF checkpoints built in tests (nothing is downloaded).

`make_tiny_checkpoint(dir, arch, **config_overrides)` writes config.json + safetensors for a
small Llama / Qwen2 / Qwen3 model made by transformers itself, so our loader and forward are
compared against the reference implementation.
"""

from __future__ import annotations

import os

import torch
import transformers

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}
TINY_CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def _arch_key(arch: str) -> str:
    for key, (_, model_name) in ARCHS.items():
        if arch.lower() in (key, model_name.lower()):
            return key
    raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(ARCHS)}")


def make_tiny_model(arch: str, seed: int = 0, **config_overrides) -> transformers.PreTrainedModel:
    """A float32 HF model of `arch` ("llama", "qwen2", "qwen3" or the class name), random
    weights with biases and norm weights perturbed so they matter."""
    config_name, model_name = ARCHS[_arch_key(arch)]
    config = getattr(transformers, config_name)(**{**TINY_CONFIG, **config_overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # norms start at 1 and biases at 0: make them matter
                param.add_(torch.randn_like(param) * 0.1)
    return model


def make_tiny_checkpoint(
    dir: str,
    arch: str,
    seed: int = 0,
    max_shard_size: str | None = None,
    **config_overrides,
) -> str:
    """Save a tiny `arch` model as safetensors under `dir` (sharded when max_shard_size is
    given, e.g. "20KB"); returns the directory."""
    model = make_tiny_model(arch, seed=seed, **config_overrides)
    os.makedirs(dir, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(dir, **kwargs)
    return str(dir)


def load_reference(model_dir: str) -> transformers.PreTrainedModel:
    """The HF model saved in model_dir, float32, eval mode."""
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def reference_logits(model: transformers.PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """HF logits [len(ids), vocab] float32 for one sequence."""
    return model(torch.tensor([ids])).logits[0].float()
