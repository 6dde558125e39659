"""Tiny draft checkpoints (EAGLE, EAGLE-3) in their public formats, and targets built so that a
draft's proposals are known to agree with them (nothing is downloaded).

- `make_tiny_eagle_draft` / `make_tiny_eagle3_draft`: random drafts for a tiny target.
- `make_bigram_target` + `make_agreeing_eagle_draft`: the target's next token depends only on
  the current token (every layer adds zero to the residual stream) and the draft computes the
  same argmax, so every drafted token is accepted.
- `make_constant_target` + `make_agreeing_eagle3_draft`: the target always predicts token 0 and
  the draft (one-token draft vocabulary mapped to 0) always proposes it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from tests.gpu_worker.checkpoints import make_tiny_model

TINY_TOKENIZER_VOCAB = 384  # >= the tiny test tokenizer's vocabulary
_LLAMA_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
)


def read_config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def draft_config(target_dir: str, architecture: str, **extra) -> dict:
    """A one-layer Llama config with the target's shapes, vocabulary and rotary settings."""
    target = read_config(target_dir)
    config = {k: target[k] for k in _LLAMA_KEYS if target.get(k) is not None}
    config.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    config.update(
        architectures=[architecture],
        model_type="llama",
        num_hidden_layers=1,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return {**config, **extra}


def save_draft(
    dir: str, config: dict, tensors: dict[str, torch.Tensor], prefix: str = "", num_shards: int = 1
) -> str:
    """Write config.json and the tensors (names prefixed by `prefix`) as safetensors, split over
    num_shards files with an index when num_shards > 1. Returns dir."""
    os.makedirs(dir, exist_ok=True)
    with open(os.path.join(dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    named = {prefix + k: v.contiguous() for k, v in tensors.items()}
    if num_shards == 1:
        save_file(named, os.path.join(dir, "model.safetensors"))
        return str(dir)
    names = sorted(named)
    weight_map = {}
    for i in range(num_shards):
        file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        shard = {n: named[n] for n in names[i::num_shards]}
        save_file(shard, os.path.join(dir, file))
        weight_map.update(dict.fromkeys(shard, file))
    with open(os.path.join(dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return str(dir)


def _matrix(gen: torch.Generator, rows: int, cols: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=gen) / cols**0.5


def _norm(gen: torch.Generator, size: int) -> torch.Tensor:
    return 1.0 + 0.1 * torch.randn(size, generator=gen)


def layer_tensors(config: dict, gen: torch.Generator, qkv_width: int) -> dict[str, torch.Tensor]:
    """Random attention + MLP + post-attention norm of one Llama layer (names under the layer);
    q/k/v read `qkv_width` features."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    return {
        "self_attn.q_proj.weight": _matrix(gen, heads * d, qkv_width),
        "self_attn.k_proj.weight": _matrix(gen, kv_heads * d, qkv_width),
        "self_attn.v_proj.weight": _matrix(gen, kv_heads * d, qkv_width),
        "self_attn.o_proj.weight": _matrix(gen, h, heads * d),
        "mlp.gate_proj.weight": _matrix(gen, inter, h),
        "mlp.up_proj.weight": _matrix(gen, inter, h),
        "mlp.down_proj.weight": _matrix(gen, h, inter),
        "post_attention_layernorm.weight": _norm(gen, h),
    }


def make_tiny_eagle_draft(
    dir: str,
    target_dir: str,
    seed: int = 0,
    *,
    prefix: str = "",
    num_shards: int = 1,
    fc_bias: bool = True,
) -> str:
    """A random EAGLE draft (`LlamaForCausalLMEagle`) for the target in target_dir. Like the
    public checkpoints it also holds tensors the model must ignore: the first layer's
    input_layernorm and copies of the embedding / LM head."""
    config = draft_config(target_dir, "LlamaForCausalLMEagle", bias=fc_bias)
    gen = torch.Generator().manual_seed(seed)
    h, vocab = config["hidden_size"], config["vocab_size"]
    tensors = {"fc.weight": _matrix(gen, h, 2 * h)}
    if fc_bias:
        tensors["fc.bias"] = 0.1 * torch.randn(h, generator=gen)
    layer = layer_tensors(config, gen, h)
    layer["input_layernorm.weight"] = _norm(gen, h)
    tensors.update({f"layers.0.{k}": v for k, v in layer.items()})
    tensors["embed_tokens.weight"] = torch.randn(vocab, h, generator=gen)
    tensors["lm_head.weight"] = torch.randn(vocab, h, generator=gen)
    return save_draft(dir, config, tensors, prefix, num_shards)


def hot_token_ids(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> torch.Tensor:
    """A deterministic sorted subset of target ids [draft_vocab_size] int64 (always has 0)."""
    gen = torch.Generator().manual_seed(seed)
    others = torch.randperm(vocab_size - 1, generator=gen)[: draft_vocab_size - 1] + 1
    return torch.cat([torch.zeros(1, dtype=torch.int64), others]).sort().values


def eagle3_tensors(
    config: dict, gen: torch.Generator, hot_ids: torch.Tensor | None, num_aux: int = 3
) -> dict[str, torch.Tensor]:
    """Random EAGLE-3 draft tensors; d2t/t2d when hot_ids (the draft vocabulary) is given."""
    h, vocab = config["hidden_size"], config["vocab_size"]
    draft_vocab = vocab if hot_ids is None else hot_ids.shape[0]
    tensors = {
        "fc.weight": _matrix(gen, h, num_aux * h),
        "midlayer.hidden_norm.weight": _norm(gen, h),
        "midlayer.input_layernorm.weight": _norm(gen, h),
        "norm.weight": _norm(gen, h),
        "lm_head.weight": _matrix(gen, draft_vocab, h),
    }
    tensors.update({f"midlayer.{k}": v for k, v in layer_tensors(config, gen, 2 * h).items()})
    if hot_ids is not None:
        tensors["d2t"] = hot_ids - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[hot_ids] = True
        tensors["t2d"] = t2d
    return tensors


def make_tiny_eagle3_draft(
    dir: str,
    target_dir: str,
    draft_vocab_size: int | None = None,
    seed: int = 0,
    *,
    prefix: str = "",
    num_shards: int = 1,
    with_embed: bool = False,
    aux_layer_ids: list[int] | None = None,
) -> str:
    """A random EAGLE-3 draft (`LlamaForCausalLMEagle3`) for the target in target_dir. With
    draft_vocab_size < vocab it has a d2t map onto `hot_token_ids(vocab, draft_vocab_size,
    seed)`. with_embed: the draft has its own embedding. aux_layer_ids: written as
    eagle_config.eagle_aux_hidden_state_layer_ids (fc then reads len(ids) * H features)."""
    extra = {}
    if aux_layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    config = draft_config(target_dir, "LlamaForCausalLMEagle3", **extra)
    vocab = config["vocab_size"]
    config["draft_vocab_size"] = draft_vocab_size or vocab
    hot_ids = None
    if draft_vocab_size is not None and draft_vocab_size < vocab:
        hot_ids = hot_token_ids(vocab, draft_vocab_size, seed)
    gen = torch.Generator().manual_seed(seed)
    num_aux = len(aux_layer_ids) if aux_layer_ids is not None else 3
    tensors = eagle3_tensors(config, gen, hot_ids, num_aux)
    if with_embed:
        tensors["embed_tokens.weight"] = torch.randn(vocab, config["hidden_size"], generator=gen)
    return save_draft(dir, config, tensors, prefix, num_shards)


@torch.no_grad()
def make_bigram_target(dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A target whose next token depends only on the current one: every o_proj and down_proj
    is zero (the residual stream stays the token embedding), the final norm weight is 1,
    embedding rows have RMS 1 (so the final norm barely changes them) and the untied LM head
    maps each token's embedding to a random successor with a wide logit margin (argmax stays
    put under bf16 rounding)."""
    overrides = {"vocab_size": TINY_TOKENIZER_VOCAB, **overrides, "tie_word_embeddings": False}
    model = make_tiny_model(arch, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        for proj in (layer.self_attn.o_proj, layer.mlp.down_proj):
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
    model.model.norm.weight.fill_(1.0)
    embed = model.model.embed_tokens.weight  # [vocab, H]
    embed.copy_(torch.randn(embed.shape, generator=gen))
    embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
    vocab, h = embed.shape
    successor = torch.randperm(vocab, generator=gen)
    head = 0.1 * torch.randn(vocab, h, generator=gen) / h**0.5
    head[successor] += embed / h  # logit of successor[t] given t: ~1; others ~N(0, 1/H)
    model.lm_head.weight.copy_(head)
    os.makedirs(dir, exist_ok=True)
    model.save_pretrained(dir)
    return str(dir)


def make_agreeing_eagle_draft(dir: str, target_dir: str, confidence: float = 50.0) -> str:
    """An EAGLE draft whose argmax equals the bigram target's for every token: fc = [c*I | 0]
    passes the (scaled) token embedding through, o_proj and down_proj are zero, so the draft's
    logits are c * lm_head(embed(t)), a positive multiple of the target's
    lm_head(norm(embed(t))). The factor c makes the draft confident (a peaked softmax), so a
    tree draft spends its nodes on the deep chain the target will accept."""
    config = draft_config(target_dir, "LlamaForCausalLMEagle", bias=False)
    h = config["hidden_size"]
    gen = torch.Generator().manual_seed(0)
    fc = torch.cat([confidence * torch.eye(h), torch.zeros(h, h)], dim=1)
    tensors = {"fc.weight": fc}
    layer = layer_tensors(config, gen, h)
    layer["self_attn.o_proj.weight"].zero_()
    layer["mlp.down_proj.weight"].zero_()
    tensors.update({f"layers.0.{k}": v for k, v in layer.items()})
    return save_draft(dir, config, tensors)


@torch.no_grad()
def make_constant_target(dir: str, arch: str = "llama", seed: int = 0, **overrides) -> str:
    """A target whose logits are all 0 (final norm weight 0), so its argmax is always 0."""
    overrides = {"vocab_size": TINY_TOKENIZER_VOCAB, **overrides}
    model = make_tiny_model(arch, seed=seed, **overrides)
    model.model.norm.weight.zero_()
    os.makedirs(dir, exist_ok=True)
    model.save_pretrained(dir)
    return str(dir)


def make_agreeing_eagle3_draft(dir: str, target_dir: str) -> str:
    """An EAGLE-3 draft with a one-token draft vocabulary mapped to target id 0 (d2t = [0]):
    it always proposes 0, which the constant target always accepts."""
    config = draft_config(target_dir, "LlamaForCausalLMEagle3", draft_vocab_size=1)
    gen = torch.Generator().manual_seed(0)
    tensors = eagle3_tensors(config, gen, hot_ids=torch.zeros(1, dtype=torch.int64))
    return save_draft(dir, config, tensors)
