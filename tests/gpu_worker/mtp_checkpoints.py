"""Tiny checkpoints with MTP layers in MiMo's layout (nothing is downloaded).

- `make_tiny_mtp_target`: a random tiny target (made by HF transformers) whose config has
  `num_nextn_predict_layers` and whose safetensors also hold that many random MTP layers
  (`model.mtp_layers.{i}.*`); transformers still loads it (it ignores the extra tensors).
- `make_tiny_mtp_dir`: random MTP layers for a target, in a separate directory.
- `make_agreeing_mtp_target`: a bigram target (see `draft_checkpoints.make_bigram_target`) with
  MTP layers whose argmax always equals the target's.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.gpu_worker.checkpoints import make_tiny_checkpoint
from tests.gpu_worker.draft_checkpoints import (
    TINY_TOKENIZER_VOCAB,
    layer_tensors,
    make_bigram_target,
    read_config,
)

# Architectures whose attention has q/k/v biases (and no o bias) whatever attention_bias says.
_QKV_BIAS_ARCHS = ("Qwen2ForCausalLM", "MiMoForCausalLM")


def _matrix(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen) / cols**0.5


def _norm(gen: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def _block_config(target_config: dict) -> dict:
    config = dict(target_config)
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    return config


def _attention_extras(config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Biases and q/k norms the target's attention has (named under the layer)."""
    arch = config["architectures"][0]
    d, heads = config["head_dim"], config["num_attention_heads"]
    kv_width = config["num_key_value_heads"] * d
    widths = {"q_proj": heads * d, "k_proj": kv_width, "v_proj": kv_width}
    if arch in _QKV_BIAS_ARCHS:
        biased = widths
    elif config.get("attention_bias"):
        biased = {**widths, "o_proj": config["hidden_size"]}
    else:
        biased = {}
    extras = {f"self_attn.{p}.bias": 0.1 * torch.randn(w, generator=gen) for p, w in biased.items()}
    if arch == "Qwen3ForCausalLM":
        extras["self_attn.q_norm.weight"] = _norm(gen, d)
        extras["self_attn.k_norm.weight"] = _norm(gen, d)
    return extras


def mtp_layer_tensors(target_config: dict, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random tensors of one MTP layer (names under `model.mtp_layers.{i}.`)."""
    config = _block_config(target_config)
    h = config["hidden_size"]
    tensors = layer_tensors(config, gen, h)
    tensors.update(_attention_extras(config, gen))
    tensors.update(
        {
            "input_layernorm.weight": _norm(gen, h),
            "token_layernorm.weight": _norm(gen, h),
            "hidden_layernorm.weight": _norm(gen, h),
            "input_proj.weight": _matrix(gen, h, 2 * h),
            "final_layernorm.weight": _norm(gen, h),
        }
    )
    return tensors


def prefixed(layer: int, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"model.mtp_layers.{layer}.{k}": v.contiguous() for k, v in tensors.items()}


def random_mtp_tensors(target_config: dict, num_mtp_layers: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 1000)
    tensors = {}
    for i in range(num_mtp_layers):
        tensors.update(prefixed(i, mtp_layer_tensors(target_config, gen)))
    return tensors


def write_config(dir: str, config: dict) -> None:
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def add_mtp_layers(target_dir: str, tensors: dict[str, torch.Tensor], num_mtp_layers: int) -> str:
    """Append MTP tensors to the target's single model.safetensors and set
    num_nextn_predict_layers in its config.json. Returns target_dir."""
    path = os.path.join(target_dir, "model.safetensors")
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})
    write_config(
        target_dir, {**read_config(target_dir), "num_nextn_predict_layers": num_mtp_layers}
    )
    return str(target_dir)


def make_tiny_mtp_target(
    dir: str, arch: str = "llama", num_mtp_layers: int = 3, seed: int = 0, **overrides
) -> str:
    """A tiny random `arch` target ("llama", "qwen2", "qwen3") with num_mtp_layers random MTP
    layers in its own safetensors; vocab 384 unless overridden. Returns dir."""
    overrides = {"vocab_size": TINY_TOKENIZER_VOCAB, **overrides}
    make_tiny_checkpoint(dir, arch, seed=seed, **overrides)
    tensors = random_mtp_tensors(read_config(dir), num_mtp_layers, seed)
    return add_mtp_layers(dir, tensors, num_mtp_layers)


def make_tiny_mtp_dir(dir: str, target_dir: str, num_mtp_layers: int = 3, seed: int = 0) -> str:
    """num_mtp_layers random MTP layers for the target in target_dir, in their own directory
    (the target's config.json with num_nextn_predict_layers, and model.safetensors holding
    only `model.mtp_layers.*`). Returns dir."""
    os.makedirs(dir, exist_ok=True)
    config = {**read_config(target_dir), "num_nextn_predict_layers": num_mtp_layers}
    write_config(dir, config)
    tensors = random_mtp_tensors(config, num_mtp_layers, seed)
    save_file(tensors, os.path.join(dir, "model.safetensors"), metadata={"format": "pt"})
    return str(dir)


def make_agreeing_mtp_target(dir: str, num_mtp_layers: int = 3, confidence: float = 50.0) -> str:
    """A bigram target whose MTP layers always predict what it does: input_proj = [0 | c*I]
    passes c * token_layernorm(e) (token_layernorm ones), o_proj and down_proj are zero so the
    block adds nothing, final_layernorm is ones, hence logits = lm_head(norm(e)) = the target's
    logits for token e. Returns dir."""
    make_bigram_target(dir)
    config = _block_config(read_config(dir))
    h = config["hidden_size"]
    gen = torch.Generator().manual_seed(1)
    tensors = {}
    for i in range(num_mtp_layers):
        layer = mtp_layer_tensors(config, gen)
        layer["input_proj.weight"] = torch.cat(
            [torch.zeros(h, h), confidence * torch.eye(h)], dim=1
        )
        for name in ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight"):
            layer.get(name, torch.zeros(0)).zero_()
        layer["token_layernorm.weight"].fill_(1.0)
        layer["final_layernorm.weight"].fill_(1.0)
        tensors.update(prefixed(i, layer))
    return add_mtp_layers(dir, tensors, num_mtp_layers)
