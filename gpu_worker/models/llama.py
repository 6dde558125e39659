"""Llama (and the shared decoder blocks Qwen2/Qwen3 reuse): GQA attention, SwiGLU MLP.

Parameter names follow HF (`model.layers.N.self_attn.o_proj.weight`, ...), except that q/k/v
and gate/up are merged (`qkv_proj`, `gate_up_proj`: one GEMM each), loaded from the
checkpoint's separate tensors. With `tie_word_embeddings`, `lm_head.weight` is the same
Parameter as `model.embed_tokens.weight`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gpu_worker.kernels import activation, small_m_linear
from gpu_worker.layers.attention import PagedAttention
from gpu_worker.layers.layernorm import RMSNorm
from gpu_worker.layers.linear import MergedLinear, RowParallelLinear, Shard
from gpu_worker.layers.rotary import RotaryEmbedding
from gpu_worker.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from gpu_worker.models.config import ArchConfig
from gpu_worker.parallel import SINGLE, TensorParallel
from gpu_worker.step.forward_batch import ForwardBatch


class LlamaAttention(nn.Module):
    """Self-attention with one merged qkv projection. qkv_bias/o_bias add projection biases
    (Qwen2), qk_norm adds per-head RMSNorm of q and k before rotary (Qwen3). Under TP this
    rank runs its query heads and the KV heads they read (`TensorParallel.kv_heads`)."""

    def __init__(
        self,
        config: ArchConfig,
        layer_id: int,
        qkv_bias: bool,
        o_bias: bool,
        qk_norm: bool,
        in_features: int | None = None,
        tp: TensorParallel = SINGLE,
    ) -> None:
        """in_features: width of the attention input (default hidden_size; EAGLE-3: 2H)."""
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        first_head, self.num_heads = tp.split(config.num_heads, "the number of attention heads")
        first_kv, self.num_kv_heads = tp.kv_heads(config.num_kv_heads)
        self.head_dim = d
        q = Shard.heads(first_head, self.num_heads, config.num_heads, d)
        kv = Shard.heads(first_kv, self.num_kv_heads, config.num_kv_heads, d)
        shards = {"q_proj": q, "k_proj": kv, "v_proj": kv}
        self.qkv_proj = MergedLinear(in_features or h, shards, qkv_bias)
        self.o_proj = RowParallelLinear(
            config.num_heads * d, h, o_bias, tp, "the attention width (heads x head_dim)"
        )
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.attn = PagedAttention(layer_id, self.num_heads, self.num_kv_heads, d, d**-0.5)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, cos_sin_cache: torch.Tensor
    ) -> torch.Tensor:
        """x [n, in_features] -> [n, hidden]; writes the layer's K/V of the new tokens."""
        qkv = self.qkv_proj(x)  # [n, (heads + 2 * kv_heads) * d]
        return self.o_proj(self.attend(qkv, batch, cos_sin_cache))  # [n, hidden]

    def attend(
        self, qkv: torch.Tensor, batch: ForwardBatch, cos_sin_cache: torch.Tensor
    ) -> torch.Tensor:
        """qkv [n, (heads + 2 * kv_heads) * d] -> attention output [n, heads * d], before
        o_proj; writes the layer's K/V of the new tokens."""
        if self.qk_norm:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
            return self.attn(qkv, batch, cos_sin_cache, *norms)
        return self.attn(qkv, batch, cos_sin_cache)


class LlamaMLP(nn.Module):
    use_triton = False

    def __init__(self, config: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        rows = Shard.split(i, tp, "intermediate_size")
        self.gate_up_proj = MergedLinear(h, {"gate_proj": rows, "up_proj": rows}, bias)
        self.down_proj = RowParallelLinear(i, h, bias, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate]
        if self.use_triton:
            return self.down_proj(activation.silu_and_mul(gate_up))
        return self.down_proj(activation.silu_and_mul_reference(gate_up))


class LlamaDecoderLayer(nn.Module):
    """A pre-norm decoder block over the residual stream, carried as (x, residual) with
    stream = x + residual so each add is fused into the norm after it.

    With Triton kernels (`use_triton`) the block goes through `gpu_worker.kernels.small_m_linear`,
    which runs each norm as the prologue of the projection after it, and SiLU-and-multiply as
    the prologue of down_proj, where that pays (one to four tokens, small weights: five kernels
    per layer); one token of large weights runs the separate norm and SiLU kernels and the same
    projection kernel without a prologue (a GEMV); more tokens the separate kernels and the
    library GEMM."""

    use_triton = False

    def __init__(
        self, config: ArchConfig, layer_id: int, tp: TensorParallel = SINGLE, **attn_options: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, tp=tp, **attn_options)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm: RMSNorm | None = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [n, hidden] (residual None: x is the whole stream) -> the same pair
        after this layer. input_layernorm None (EAGLE's first layer) feeds x in unnormalised."""
        if self.use_triton:
            return self._forward_triton(x, residual, batch, cos_sin_cache)
        if residual is None:
            residual = x
            if self.input_layernorm is not None:
                x = self.input_layernorm(x)
        else:
            assert self.input_layernorm is not None, "an un-normed layer must come first"
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, batch, cos_sin_cache)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def _forward_triton(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        cos_sin_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the norms and SiLU-and-multiply handed to the projections after
        them; the same values as the reference path."""
        attn, mlp = self.self_attn, self.mlp
        qkv_proj, gate_up_proj = attn.qkv_proj, mlp.gate_up_proj
        norm = self.input_layernorm
        if norm is None:
            assert residual is None, "an un-normed layer must come first"
            qkv, residual = small_m_linear.linear(x, qkv_proj.weight, qkv_proj.bias), x
        else:
            qkv, residual = small_m_linear.rms_norm_linear(
                x, residual, norm.weight, norm.eps, qkv_proj.weight, qkv_proj.bias
            )
        o = attn.attend(qkv, batch, cos_sin_cache)
        x = attn.o_proj.reduce(small_m_linear.linear(o, attn.o_proj.weight, attn.o_proj.bias))
        norm = self.post_attention_layernorm
        gate_up, residual = small_m_linear.rms_norm_linear(
            x, residual, norm.weight, norm.eps, gate_up_proj.weight, gate_up_proj.bias
        )
        down = mlp.down_proj
        out = small_m_linear.silu_mul_linear(gate_up, down.weight, down.bias)
        return down.reduce(out), residual


def run_layers(
    layers: Sequence[LlamaDecoderLayer],
    x: torch.Tensor,
    batch: ForwardBatch,
    cos_sin_cache: torch.Tensor,
    aux_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
    """Run layers over the stream x -> (x, residual, captured): the stream after the last
    layer is x + residual; captured holds the stream ENTERING each layer id of aux_layers (id
    len(layers): the stream after the last layer), in the listed order."""
    residual = None
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(layers):
        if i in aux_layers:
            captured[i] = x if residual is None else x + residual
        x, residual = layer(x, residual, batch, cos_sin_cache)
    if len(layers) in aux_layers:
        captured[len(layers)] = x + residual
    return x, residual, [captured[i] for i in aux_layers]


class LlamaModel(nn.Module):
    def __init__(self, config: ArchConfig, tp: TensorParallel = SINGLE, **attn_options: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, tp, **attn_options) for i in range(config.num_layers)
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
        cache = self.rotary.cos_sin_cache
        x, residual, captured = run_layers(self.layers, x, batch, cache, aux_layers)
        hidden, _ = self.norm(x, residual)
        return hidden, torch.cat(captured, dim=-1) if aux_layers else None


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ArchConfig, tp: TensorParallel = SINGLE) -> None:
        """tp: this rank's place in its tensor-parallel group (`gpu_worker.parallel`)."""
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, tp, **self.attention_options(config))
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, tp)
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

    def logits_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the LM head reads: the final norm is the model's last layer."""
        return hidden

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
