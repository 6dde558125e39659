"""config.json parsing for real-world spellings, and a Llama-3.1-8B-shaped model on meta."""

from __future__ import annotations

import torch

from gpu_worker.models import build_model
from gpu_worker.models.config import arch_config_from_dict

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_llama31_config_and_parameter_count():
    config = arch_config_from_dict(LLAMA_31_8B)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling["rope_type"] == "llama3" and config.rope_scaling["factor"] == 8.0
    assert (config.head_dim, config.num_kv_heads, config.torch_dtype) == (128, 8, "bfloat16")
    model = build_model(config, "meta", torch.bfloat16)
    num_params = sum(p.numel() for p in model.parameters())
    assert num_params == 8_030_261_248  # the published size of Llama-3.1-8B


def test_transformers5_rope_parameters_spelling():
    cfg = {**LLAMA_31_8B, "rope_parameters": {**LLAMA_31_8B["rope_scaling"], "rope_theta": 1e6}}
    del cfg["rope_scaling"], cfg["rope_theta"]
    config = arch_config_from_dict(cfg)
    assert config.rope_theta == 1e6 and config.rope_scaling["rope_type"] == "llama3"
    plain = arch_config_from_dict(
        {**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}
    )
    assert plain.rope_theta == 5.0 and plain.rope_scaling is None
