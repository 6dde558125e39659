"""Architecture registry keyed by config.json's `architectures[0]`."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.models.config import ArchConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]


def build_model(config: ArchConfig, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """An uninitialised model of `config` on `device` in `dtype` (weights are garbage until
    loaded or dummy-initialised). Built on the meta device first, so nothing is initialised
    twice."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()
