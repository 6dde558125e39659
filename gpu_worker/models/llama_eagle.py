"""EAGLE-1/2 Llama draft (`LlamaForCausalLMEagle`, the public EAGLE format), and the contract
every draft model follows.

A draft reads one hidden state per token (`batch.spec_info.hidden_states`) besides the tokens,
and uses the TARGET's embedding and LM head (the same Parameters, `attach_target`).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.models.config import ArchConfig
from gpu_worker.models.llama import LlamaDecoderLayer, LlamaForCausalLM, run_layers
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.step.forward_batch import ForwardBatch

# Tensors a draft checkpoint may hold that a draft model never loads.
_ALWAYS_SKIPPED = ("rotary_emb.inv_freq",)


def strip_model_prefix(name: str) -> str:
    """Draft checkpoints name tensors with or without a `model.` prefix; use the bare name."""
    return name.removeprefix("model.")


def normalized_names(tensor_names: set[str] | None) -> set[str] | None:
    return None if tensor_names is None else {strip_model_prefix(n) for n in tensor_names}


def target_embed_and_head(target: nn.Module) -> tuple[nn.Embedding, nn.Linear]:
    """The embedding and LM head modules of a target model (Llama/Qwen layout)."""
    return target.model.embed_tokens, target.lm_head


def read_spec_hidden(batch: ForwardBatch) -> torch.Tensor:
    """batch.spec_info.hidden_states [num_tokens, H_in], checked against the batch."""
    spec_info = batch.spec_info
    if spec_info is None or getattr(spec_info, "hidden_states", None) is None:
        raise ValueError("a draft forward needs batch.spec_info.hidden_states")
    hidden = spec_info.hidden_states
    if hidden.shape[0] != batch.num_tokens:
        raise ValueError(f"{hidden.shape[0]} hidden states for {batch.num_tokens} tokens")
    return hidden


class LlamaForCausalLMEagle(nn.Module):
    """h = fc(cat(embed(ids), hidden)) (2H -> H); h = decoder layers(h) (the first layer's
    input_layernorm an identity); logits = target_lm_head(h), no final norm; h is the next
    draft step's hidden.

    The draft-model contract (`LlamaForCausalLMEagle3`, `MiMoMTPLayer` follow it):
    `__init__(config, tensor_names, tp)`: tensor_names (the checkpoint's, None for dummy
    weights) decides which optional modules the draft owns, so nothing is allocated twice; tp
    is the target's group (decoder layers and any embedding or LM head of its own sharded like
    the target's, the small input projection replicated). `forward(batch) -> [num_tokens, H]`
    pass-back hidden; `compute_logits(hidden) -> [n, V]` float32. `attach_target(target)`,
    after loading, shares the target's modules and finishes derived tensors: until then the
    draft cannot run."""

    def __init__(
        self,
        config: ArchConfig,
        tensor_names: set[str] | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.config = config
        names = normalized_names(tensor_names)
        h = config.hidden_size
        has_bias = bool(config.raw.get("bias")) if names is None else "fc.bias" in names
        self.fc = nn.Linear(2 * h, h, bias=has_bias)
        attn_options = LlamaForCausalLM.attention_options(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, **attn_options) for i in range(config.num_layers)
        )
        # NOTE: EAGLE's first layer has no input norm: fc's output enters attention as is.
        self.layers[0].input_layernorm = None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens: nn.Embedding | None = None  # the target's, see attach_target
        self.lm_head: nn.Linear | None = None

    def tie_weights(self) -> None:
        """Nothing is tied inside the draft (sharing with the target is `attach_target`)."""

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name; the target-owned embedding/head and the identity
        first input norm are skipped."""
        name = strip_model_prefix(name)
        skipped = ("embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")
        if name in skipped or name.endswith(_ALWAYS_SKIPPED):
            return None
        return name

    def attach_target(self, target: nn.Module) -> None:
        """Use the target's embedding and LM head modules (shared Parameters, not copies)."""
        embed, head = target_embed_and_head(target)
        if embed.embedding_dim != self.config.hidden_size:
            raise ValueError(
                f"EAGLE draft hidden size {self.config.hidden_size} != target's "
                f"{embed.embedding_dim}"
            )
        self.embed_tokens, self.lm_head = embed, head

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> pass-back hidden [num_tokens, H] (pre-LM-head, no final norm)."""
        hidden_in = read_spec_hidden(batch)  # [num_tokens, H]
        embeds = self.embed_tokens(batch.input_ids)  # [num_tokens, H]
        x = self.fc(torch.cat((embeds, hidden_in.to(embeds.dtype)), dim=-1))  # [num_tokens, H]
        x, residual, _ = run_layers(self.layers, x, batch, self.rotary.cos_sin_cache)
        return x + residual

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the hidden itself (no final norm)."""
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab] float32 through the target's LM head."""
        return self.lm_head(hidden).float()
