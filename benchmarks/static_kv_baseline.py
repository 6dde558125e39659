"""A gpt-fast-style baseline for `bench_decode`: a minimal static-KV Llama decoder compiled with
`torch.compile(mode="reduce-overhead")`, on the same weights as an Aerie model. One KV tensor
per layer [bs, kv_heads, max_seq_len, head_dim], updated in place at a device-tensor position so
one compiled graph serves every step; it only decodes, from an empty cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.models.llama import LlamaForCausalLM


class StaticKVDecoder(nn.Module):
    def __init__(self, model: LlamaForCausalLM, batch_size: int, max_seq_len: int) -> None:
        super().__init__()
        config = model.config
        self.model = model  # shares its Parameters (merged qkv / gate_up included)
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        weight = model.lm_head.weight
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_seq_len, config.head_dim)
        for name in ("k_cache", "v_cache"):
            self.register_buffer(name, torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        causal = torch.ones(max_seq_len, max_seq_len, dtype=torch.bool, device=weight.device)
        self.register_buffer("causal", causal.tril())
        self.cos_sin = model.model.rotary.cos_sin_cache  # [max_positions, head_dim] float32

    @staticmethod
    def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        xf = x.float()
        return norm.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).to(
            x.dtype
        )

    def rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """x [bs, heads, 1, D] at position pos [1]."""
        cos, sin = self.cos_sin[pos].chunk(2, dim=-1)  # [1, D/2]
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """tokens [bs] at position pos [1] (int64, on the device) -> logits [bs, V] float32."""
        bs, h, kh, d = tokens.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = self.model.model.embed_tokens(tokens)  # [bs, H]
        mask = self.causal[pos][None, None]  # [1, 1, 1, max_seq_len]
        for i, layer in enumerate(self.model.model.layers):
            attn = layer.self_attn
            qkv = F.linear(
                self.rms_norm(x, layer.input_layernorm), attn.qkv_proj.weight, attn.qkv_proj.bias
            )
            q, k, v = qkv.split([h * d, kh * d, kh * d], dim=-1)
            q = self.rope(q.view(bs, h, 1, d), pos)
            k = self.rope(k.view(bs, kh, 1, d), pos)
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v.view(bs, kh, 1, d))
            o = F.scaled_dot_product_attention(
                q, self.k_cache[i], self.v_cache[i], attn_mask=mask, enable_gqa=True
            )  # [bs, h, 1, d]
            x = x + attn.o_proj(o.reshape(bs, h * d))
            mlp = layer.mlp
            normed = self.rms_norm(x, layer.post_attention_layernorm)
            gate, up = mlp.gate_up_proj(normed).chunk(2, -1)
            x = x + mlp.down_proj(F.silu(gate) * up)
        return self.model.lm_head(self.rms_norm(x, self.model.model.norm)).float()


def compile_decoder(model: LlamaForCausalLM, batch_size: int, max_seq_len: int):
    """(decoder, step): step(tokens, pos) runs one compiled decode step."""
    decoder = StaticKVDecoder(model, batch_size, max_seq_len)
    step = torch.compile(decoder, mode="reduce-overhead", fullgraph=True, dynamic=False)
    return decoder, step
