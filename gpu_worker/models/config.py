"""`ArchConfig`: the architecture facts a model needs, read from a checkpoint's config.json.

Accepts both spellings of rotary settings: `rope_theta` + `rope_scaling` (older files, e.g.
Llama-3.1) and `rope_parameters` (written by transformers 5).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str | None
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = cfg.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type") or params.get("type") or "default"
    scaling = None if rope_type == "default" else {**params, "rope_type": rope_type}
    return float(theta), scaling


def arch_config_from_dict(cfg: dict[str, Any]) -> ArchConfig:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    num_heads = cfg["num_attention_heads"]
    rope_theta, rope_scaling = _rope_settings(cfg)
    return ArchConfig(
        architecture=(cfg.get("architectures") or ["?"])[0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        raw=cfg,
    )


def read_arch_config(model_dir: str) -> ArchConfig:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{model_dir!r} has no config.json")
    with open(path) as f:
        return arch_config_from_dict(json.load(f))
