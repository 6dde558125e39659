"""MTP layers in MiMo's layout (multi-layer EAGLE): one small model per layer, `MiMoMTPLayer`.

A target with `num_nextn_predict_layers: N` ships N blocks `model.mtp_layers.{i}.*`
(token_layernorm, hidden_layernorm, input_proj [H, 2H], final_layernorm and a decoder block
like the target's), in its own safetensors or a separate directory with the same names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import torch
from torch import nn

from gpu_worker.kv_cache import kv_bytes_per_token
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.config import ArchConfig, read_arch_config
from gpu_worker.models.llama import LlamaDecoderLayer
from gpu_worker.models.llama_eagle import read_spec_hidden, target_embed_and_head
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.step.forward_batch import ForwardBatch
from gpu_worker.weights import WeightLoadError, list_tensor_names

MTP_ARCHITECTURE = "MiMoMTPLayer"
# Tensors of MTP layer i, with or without the leading `model.`.
_MTP_NAME = re.compile(r"^(?:model\.)?mtp_layers\.(\d+)\.(.+)$")
_OWN_MODULES = ("token_layernorm.", "hidden_layernorm.", "input_proj.", "final_layernorm.")


def num_mtp_layers(model_dir: str) -> int:
    """config.json's `num_nextn_predict_layers` (0 if absent)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f).get("num_nextn_predict_layers") or 0)


def _mtp_layer_ids(model_dir: str) -> set[int]:
    """Indices of the MTP layers whose tensors the checkpoint holds (headers only)."""
    names = list_tensor_names(model_dir)
    return {int(m.group(1)) for m in map(_MTP_NAME.match, names) if m is not None}


def _holds_mtp_layers(model_dir: str) -> bool:
    try:
        return bool(_mtp_layer_ids(model_dir))
    except WeightLoadError:  # no weight files at all
        return False


def mtp_weights_dir(target_dir: str, draft_dir: str | None) -> str:
    """Where the MTP layers are: draft_dir if given (it must hold `mtp_layers` tensors), else
    target_dir if its tensors include `model.mtp_layers.*`. Raises ValueError naming both
    directories otherwise."""
    if draft_dir:
        if _holds_mtp_layers(draft_dir):
            return draft_dir
        where = f"the draft directory {draft_dir!r}"
    elif _holds_mtp_layers(target_dir):
        return target_dir
    else:
        where = f"the target {target_dir!r} (and no draft directory was given)"
    raise ValueError(
        f"no MTP layers (model.mtp_layers.* tensors) in {where}; target {target_dir!r}, draft "
        f"{draft_dir!r}. Pass --speculative-draft-model-path pointing at a directory with them"
    )


def mtp_arch_config(config: ArchConfig, layer: int) -> ArchConfig:
    """The config of MTP layer `layer` of the target described by `config`: one decoder layer
    (its KV pool has one layer), architecture MTP_ARCHITECTURE; `raw` keeps the target's
    fields (its `architectures` decide the block's attention options)."""
    num_layers = int(config.raw.get("num_nextn_predict_layers") or 0)
    if not 0 <= layer < num_layers:
        raise ValueError(
            f"MTP layer {layer} does not exist: the config has num_nextn_predict_layers="
            f"{num_layers}"
        )
    return dataclasses.replace(config, architecture=MTP_ARCHITECTURE, num_layers=1)


def mtp_kv_bytes_per_token(
    model_dir: str, dtype: torch.dtype, num_layers: int | None = None
) -> int:
    """KV bytes per token of the pools of num_layers MTP runners together (one KV layer each;
    default: every layer the config has)."""
    config = read_arch_config(model_dir)
    num_layers = num_mtp_layers(model_dir) if num_layers is None else num_layers
    return num_layers * kv_bytes_per_token(1, config.num_kv_heads, config.head_dim, dtype)


def _block_attention_options(config: ArchConfig) -> dict[str, bool]:
    """The target architecture's attention options (bias, q/k norm) for the MTP block."""
    from gpu_worker.models.registry import get_model_class

    target_arch = (config.raw.get("architectures") or ["LlamaForCausalLM"])[0]
    return get_model_class(target_arch).attention_options(config)


class MiMoMTPLayer(nn.Module):
    """MTP layer `mtp_layer` of a MiMo-layout checkpoint. Per token (target hidden h at the
    same position, embedding e of the token):
    x = input_proj(cat(hidden_layernorm(h), token_layernorm(e))); x = decoder block(x);
    out = final_layernorm(x); logits = target_lm_head(out); out is passed back as its hidden.
    The block has the target's attention options and is layer 0 of its runner's one-layer pool.

    Follows the draft-model contract of `llama_eagle.py`; tensor_names is accepted for it and
    unused (the layout has no optional modules)."""

    def __init__(
        self,
        config: ArchConfig,
        tensor_names: set[str] | None = None,
        mtp_layer: int = 0,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        self.mtp_layer = mtp_layer
        h, eps = config.hidden_size, config.rms_norm_eps
        self.token_layernorm = RMSNorm(h, eps)
        self.hidden_layernorm = RMSNorm(h, eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.block = LlamaDecoderLayer(config, 0, tp, **_block_attention_options(config))
        self.final_layernorm = RMSNorm(h, eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens: nn.Embedding | None = None  # the target's, see attach_target
        self.lm_head: nn.Linear | None = None

    def tie_weights(self) -> None:
        """Nothing is tied inside the layer (sharing with the target is `attach_target`)."""

    def map_weight_name(self, name: str) -> str | None:
        """`[model.]mtp_layers.{this layer}.X` -> parameter name; every other tensor (the
        target's, other MTP layers') is skipped."""
        match = _MTP_NAME.match(name)
        if match is None or int(match.group(1)) != self.mtp_layer:
            return None
        rest = match.group(2)
        if rest.endswith("rotary_emb.inv_freq"):
            return None
        return rest if rest.startswith(_OWN_MODULES) else f"block.{rest}"

    def attach_target(self, target: nn.Module) -> None:
        """Use the target's embedding and LM head modules (shared Parameters, not copies)."""
        embed, head = target_embed_and_head(target)
        if embed.embedding_dim != self.config.hidden_size:
            raise ValueError(
                f"MTP hidden size {self.config.hidden_size} != target's {embed.embedding_dim}"
            )
        self.embed_tokens, self.lm_head = embed, head

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Reads batch.spec_info.hidden_states [num_tokens, H] (the target's hidden at each
        token's position); writes the block's KV into the batch's pool (layer 0) ->
        out [num_tokens, H] after final_layernorm."""
        hidden_in = read_spec_hidden(batch)  # [num_tokens, H]
        embeds = self.embed_tokens(batch.input_ids)  # [num_tokens, H]
        features = torch.cat(
            (self.hidden_layernorm(hidden_in.to(embeds.dtype)), self.token_layernorm(embeds)),
            dim=-1,
        )  # [num_tokens, 2H]
        x = self.input_proj(features)  # [num_tokens, H]
        x, residual = self.block(x, None, batch, self.rotary.cos_sin_cache)
        return self.final_layernorm(x, residual)[0]

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the layer's output, after its final norm."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] float32 through the target's LM head."""
        return self.lm_head(hidden).float()
