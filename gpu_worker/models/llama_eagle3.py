"""EAGLE-3 Llama draft (`LlamaForCausalLMEagle3`, the public EAGLE-3 format) and the target layers
it reads features from: the residual stream entering a few target layers (aux hidden states,
concatenated to [num_tokens, num_aux * H]). Draft-model contract: `llama_eagle.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels import norm, small_m_linear
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from gpu_worker.models.config import ArchConfig
from gpu_worker.models.llama import LlamaAttention, LlamaMLP
from gpu_worker.models.llama_eagle import (
    normalized_names,
    read_spec_hidden,
    strip_model_prefix,
    target_embed_and_head,
)
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.step.forward_batch import ForwardBatch

NUM_DEFAULT_AUX_LAYERS = 3


def configured_aux_layer_ids(draft_config: dict) -> list[int] | None:
    """`eagle_aux_hidden_state_layer_ids` from `eagle_config` or the top level, or None."""
    eagle_config = draft_config.get("eagle_config") or {}
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(i) for i in ids]


def eagle3_aux_layer_ids(draft_config: dict, num_target_layers: int) -> list[int]:
    """Target layers whose INPUT stream the target captures for an EAGLE-3 draft.

    A config's `eagle_aux_hidden_state_layer_ids` name layer OUTPUTS, so each id i is captured
    at the input of layer i + 1 (id L-1 -> L, the stream after the last layer, before the final
    norm). Without them: inputs of [2, L//2, L-3], clamped into [0, L] so tiny models work.
    """
    num_layers = num_target_layers
    ids = configured_aux_layer_ids(draft_config)
    if ids is None:
        defaults = [2, num_layers // 2, num_layers - 3]
        return [min(max(i, 0), num_layers) for i in defaults]
    layers = [i + 1 for i in ids]
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(
            f"eagle_aux_hidden_state_layer_ids {ids} out of range for {num_layers} target layers"
        )
    return layers


class Eagle3DecoderLayer(nn.Module):
    """The draft's single layer (`midlayer.*` in checkpoints). With Triton kernels
    (`use_triton`) the two input norms write the halves of one buffer and the projections go
    through `small_m_linear` (the post-attention norm fused into gate_up, SiLU-and-multiply
    into down) as the target's layers do; the same values as the reference path."""

    use_triton = False

    def __init__(self, config: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        bias = config.attention_bias
        self.self_attn = LlamaAttention(
            config, 0, qkv_bias=bias, o_bias=bias, qk_norm=False, in_features=2 * h, tp=tp
        )  # q/k/v read the 2H-wide cat(embeds, hidden)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        """embeds, hidden [n, H] -> h [n, H] (pre-norm; hidden is the residual)."""
        if self.use_triton:
            return self._forward_triton(embeds, hidden, batch, cos_sin_cache)
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)  # [n, 2H]
        attn = self.self_attn(x, batch, cos_sin_cache)
        normed, h = self.post_attention_layernorm(attn, hidden)  # h = hidden + attn
        return h + self.mlp(normed)

    def _forward_triton(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        n, h = embeds.shape
        x = torch.empty(n, 2 * h, dtype=embeds.dtype, device=embeds.device)  # cat(...) in place
        first, second = self.input_layernorm, self.hidden_norm
        norm.rms_norm(embeds, first.weight, first.eps, out=x[:, :h])
        norm.rms_norm(hidden, second.weight, second.eps, out=x[:, h:])
        attn, mlp = self.self_attn, self.mlp
        qkv = small_m_linear.linear(x, attn.qkv_proj.weight, attn.qkv_proj.bias)
        o = attn.attend(qkv, batch, cos_sin_cache)
        o = attn.o_proj.reduce(small_m_linear.linear(o, attn.o_proj.weight, attn.o_proj.bias))
        post = self.post_attention_layernorm
        gate_up, summed = small_m_linear.rms_norm_linear(
            o, hidden, post.weight, post.eps, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
        )  # summed = hidden + attention
        down = mlp.down_proj
        return summed + down.reduce(small_m_linear.silu_mul_linear(gate_up, down.weight, down.bias))


class LlamaForCausalLMEagle3(nn.Module):
    """hidden_in = fc(hidden) if hidden is aux-wide (num_aux*H -> H) else hidden;
    x = cat(input_layernorm(embed(ids)), hidden_norm(hidden_in)) [n, 2H];
    h = hidden_in + o_proj(attention(x)); h = h + mlp(post_attention_layernorm(h));
    logits = lm_head(norm(h)) over the DRAFT vocabulary, mapped to target ids by
    hot_token_id = arange(draft_vocab) + d2t. The pre-norm h is passed back; the embedding is
    the target's unless the checkpoint has its own."""

    use_triton = False  # fc through small_m_linear (see Eagle3DecoderLayer)

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
        self.draft_vocab_size = int(config.raw.get("draft_vocab_size") or config.vocab_size)
        smaller_vocab = self.draft_vocab_size != config.vocab_size
        target_hidden = int(config.raw.get("target_hidden_size") or h)
        num_aux = len(configured_aux_layer_ids(config.raw) or range(NUM_DEFAULT_AUX_LAYERS))
        self.aux_width = num_aux * target_hidden
        has_bias = names is not None and "fc.bias" in names
        self.fc = nn.Linear(self.aux_width, h, bias=has_bias)
        self.midlayer = Eagle3DecoderLayer(config, tp)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.embed_tokens: nn.Embedding | None = None
        if names is not None and "embed_tokens.weight" in names:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, tp)
        self.lm_head: nn.Linear | None = None
        if smaller_vocab or (names is not None and "lm_head.weight" in names):
            self.lm_head = ParallelLMHead(h, self.draft_vocab_size, tp)
        self.d2t: nn.Parameter | None = None
        if smaller_vocab or (names is not None and "d2t" in names):
            self.d2t = nn.Parameter(
                torch.zeros(self.draft_vocab_size, dtype=torch.int64), requires_grad=False
            )
        self.hot_token_id: torch.Tensor | None = None  # [draft_vocab] int64, see attach_target

    def tie_weights(self) -> None:
        """Nothing is tied inside the draft (sharing with the target is `attach_target`)."""

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint name -> parameter name (`layers.0.*` is accepted for `midlayer.*`;
        `t2d` is skipped)."""
        name = strip_model_prefix(name)
        if name == "t2d" or name.endswith("rotary_emb.inv_freq"):
            return None
        if name.startswith("layers.0."):
            name = "midlayer." + name.removeprefix("layers.0.")
        return name

    def attach_target(self, target: nn.Module) -> None:
        """Share the target's embedding (and LM head when the draft has none), then derive
        `hot_token_id` from the loaded d2t."""
        embed, head = target_embed_and_head(target)
        if self.embed_tokens is None:
            self.embed_tokens = embed
        if self.lm_head is None:
            self.lm_head = head
        if self.d2t is not None:
            ids = torch.arange(self.draft_vocab_size, device=self.d2t.device)
            self.hot_token_id = ids + self.d2t.detach()  # [draft_vocab]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> pass-back hidden [num_tokens, H] (before the final norm). The incoming hidden is
        aux-wide after a target forward (fc applies) or H-wide from the draft itself."""
        hidden_in = read_spec_hidden(batch)  # [num_tokens, aux_width or H]
        embeds = self.embed_tokens(batch.input_ids)  # [num_tokens, H]
        hidden_in = hidden_in.to(embeds.dtype)
        if hidden_in.shape[-1] != self.config.hidden_size:
            if self.use_triton:
                hidden_in = small_m_linear.linear(hidden_in, self.fc.weight, self.fc.bias)
            else:
                hidden_in = self.fc(hidden_in)  # [num_tokens, H]
        return self.midlayer(embeds, hidden_in, batch, self.rotary.cos_sin_cache)

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the pass-back hidden after the final norm."""
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, draft_vocab] float32 (map argmax ids by hot_token_id)."""
        return self.lm_head(self.logits_input(hidden)).float()
