"""Llama (and the shared decoder blocks Qwen2/Qwen3 reuse): GQA attention, SwiGLU MLP.

Parameter names follow HF (`model.layers.N.self_attn.q_proj.weight`, ...). With
`tie_word_embeddings`, `lm_head.weight` is the same Parameter as `model.embed_tokens.weight`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.rotary import RotaryEmbedding, apply_rotary
from gpu_worker.models.config import ArchConfig


class LlamaAttention(nn.Module):
    """Self-attention. qkv_bias/o_bias add projection biases (Qwen2), qk_norm adds per-head
    RMSNorm of q and k before rotary (Qwen3)."""

    def __init__(
        self, config: ArchConfig, layer_id: int, qkv_bias: bool, o_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.qk_norm = qk_norm
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, d, d**-0.5)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = self.attn(q.reshape(n, -1), k.reshape(n, -1), v, batch)  # [n, heads * d]
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ArchConfig, layer_id: int, **attn_options: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, **attn_options)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """x [n, hidden] (the residual stream) -> the stream after this layer."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig, **attn_options: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, **attn_options) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(
        self, batch: ForwardBatch, aux_layers: Sequence[int] = ()
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (hidden [num_tokens, hidden] after the final norm, aux or None).

        aux_layers: capture the residual stream ENTERING each of these layers (id num_layers =
        the stream after the last layer, before the final norm); aux is their concatenation
        [num_tokens, len(aux_layers) * hidden] in the listed order (EAGLE-3 features).
        """
        x = self.embed_tokens(batch.input_ids)  # [num_tokens, hidden]
        cos, sin = self.rotary.cos_sin(batch.positions)  # [num_tokens, head_dim]
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                captured[i] = x
            x = layer(x, cos, sin, batch)
        captured[len(self.layers)] = x
        aux = torch.cat([captured[i] for i in aux_layers], dim=-1) if aux_layers else None
        return self.norm(x), aux


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, **self.attention_options(config))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with lm_head when the config says so (call again after any
        operation that may replace Parameters, such as `to_empty`)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def attention_options(cls, config: ArchConfig) -> dict[str, bool]:
        return {
            "qkv_bias": config.attention_bias,
            "o_bias": config.attention_bias,
            "qk_norm": False,
        }

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)[0]

    def forward_with_aux(
        self, batch: ForwardBatch, aux_layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [num_tokens, hidden], aux [num_tokens, len(aux_layers) * hidden]): aux is
        the residual stream entering each listed layer (see `LlamaModel.forward`)."""
        hidden, aux = self.model(batch, aux_layers)
        assert aux is not None, "forward_with_aux needs at least one aux layer"
        return hidden, aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32."""
        return self.lm_head(hidden).float()

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name, or None to skip the tensor (MTP layers,
        `model.mtp_layers.*`, belong to the MTP draft runners)."""
        if "rotary_emb.inv_freq" in name or name.startswith("model.mtp_layers."):
            return None
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return None
        return name
