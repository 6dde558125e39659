"""Facts about a model directory that several processes need, read from its JSON files.

Reads `config.json` and, when present, `generation_config.json`; never loads weights and never
imports torch, so the scheduler and tokenizer processes can use it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass


class ModelDirError(ValueError):
    """The model directory is missing or does not hold what a model needs."""


@dataclass(frozen=True)
class ModelInfo:
    path: str
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # as written in config.json ("bfloat16", ...), if at all


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def read_model_info(path: str) -> ModelInfo:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelDirError(
            f"{path!r} is not a model directory: no config.json there. Pass --model-path "
            "a Hugging Face checkpoint directory (config.json + *.safetensors)."
        )
    with open(config_path) as f:
        cfg = json.load(f)
    eos = _as_tuple(cfg.get("eos_token_id"))
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = tuple(dict.fromkeys(eos + _as_tuple(json.load(f).get("eos_token_id"))))
    architectures = cfg.get("architectures") or ["?"]
    num_heads = cfg["num_attention_heads"]
    return ModelInfo(
        path=path,
        architecture=architectures[0],
        model_type=cfg.get("model_type", "?"),
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        eos_token_ids=eos,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
