"""The models the benchmarks run: the Llama-3.1-8B shape and the default model's shape as
config-only directories (random weights, `--load-format dummy`), and `--models` entries."""

from __future__ import annotations

import argparse
import json
import os

LLAMA31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}


def write_llama8b_config(directory: str) -> str:
    """Write the Llama-3.1-8B config.json into `directory`; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(LLAMA31_8B_CONFIG, f, indent=2)
    return directory


def smollm2_shape_dir(directory: str) -> str:
    """The default model's config.json alone (its shape, for random weights)."""
    from aerie.default_model import ensure_default_model

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(ensure_default_model(), "config.json")) as f:
        config = f.read()
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write(config)
    return directory


def resolve_model(name: str, tmp_dir: str, args: argparse.Namespace) -> tuple[str, str]:
    """(model directory, load format) for a --models entry."""
    if name == "smollm2":
        if args.real_weights:
            from aerie.default_model import ensure_default_model

            return ensure_default_model(), "auto"
        return smollm2_shape_dir(os.path.join(tmp_dir, "smollm2")), "dummy"
    if name == "llama3-8b":
        return write_llama8b_config(os.path.join(tmp_dir, "llama3-8b")), "dummy"
    if not os.path.isdir(name):
        raise SystemExit(f"--models entry {name!r} is neither smollm2, llama3-8b nor a directory")
    return name, args.load_format
