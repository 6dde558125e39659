"""Architecture registry keyed by config.json's `architectures[0]`.

Targets (`LlamaForCausalLM`, Qwen, MiMo as a Qwen2) run on their own; drafts
(`DRAFT_ARCHITECTURES`) read hidden states from `batch.spec_info` and borrow modules from a target
through `attach_target` (the contract is in `llama_eagle.py`). An MTP layer (`mimo_mtp.py`) is
a draft whose config the runner derives from the target's (`mtp_arch_config`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_worker.models.config import ArchConfig
from gpu_worker.models.llama import LlamaForCausalLM
from gpu_worker.models.llama_eagle import LlamaForCausalLMEagle
from gpu_worker.models.llama_eagle3 import LlamaForCausalLMEagle3
from gpu_worker.models.mimo_mtp import MTP_ARCHITECTURE, MiMoMTPLayer
from gpu_worker.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MiMoForCausalLM": Qwen2ForCausalLM,  # Qwen2 blocks (q/k/v bias) + MTP layers
    "LlamaForCausalLMEagle": LlamaForCausalLMEagle,
    "LlamaForCausalLMEagle3": LlamaForCausalLMEagle3,
    MTP_ARCHITECTURE: MiMoMTPLayer,
}
DRAFT_ARCHITECTURES = frozenset(
    {"LlamaForCausalLMEagle", "LlamaForCausalLMEagle3", MTP_ARCHITECTURE}
)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {sorted(MODEL_REGISTRY)}"
        )
    return MODEL_REGISTRY[architecture]


def is_draft_architecture(architecture: str) -> bool:
    """True for draft formats that need a target (`attach_target`) and `spec_info` hidden."""
    return architecture in DRAFT_ARCHITECTURES


def build_model(
    config: ArchConfig, device: torch.device | str, dtype: torch.dtype, **model_options: Any
) -> nn.Module:
    """An uninitialised model of `config` on `device` in `dtype` (weights are garbage until
    loaded or dummy-initialised). Built on the meta device first, so nothing is initialised
    twice. model_options go to the class (drafts take `tensor_names`, an MTP layer `mtp_layer`;
    every model `tp`, its tensor-parallel group)."""
    cls = get_model_class(config.architecture)
    with torch.device("meta"):
        model = cls(config, **model_options)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    model.requires_grad_(False)
    return model.eval()
