"""`PagedAttention`: the layer-side handle of attention. It owns no weights: given the merged
qkv projection it asks the batch's attention backend to apply RoPE (and Qwen3's per-head q/k
norm), store the new K/V into this layer's KV pool at `batch.out_cache_loc`, and attend over
the paged KV (`AttentionBackend.attend`; fused into one kernel for triton's decode)."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.attention.base import RopeArgs
from gpu_worker.step.forward_batch import ForwardBatch


class PagedAttention(nn.Module):
    def __init__(
        self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int, scaling: float
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling

    def forward(
        self,
        qkv: torch.Tensor,
        batch: ForwardBatch,
        cos_sin_cache: torch.Tensor,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
        eps: float = 1e-6,
    ) -> torch.Tensor:
        """qkv [n, (heads + 2 * kv_heads) * d] -> o [n, heads * d]. Writes the new tokens' K/V
        into the batch's KV pool (this layer)."""
        rope = RopeArgs(cos_sin_cache, q_norm, k_norm, eps)
        return batch.attn_backend.attend(qkv, self, batch, rope)
