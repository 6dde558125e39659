"""`PagedAttention`: the layer-side handle of attention. It owns no weights: given the merged
qkv projection it applies RoPE (and Qwen3's per-head q/k norm) to q and k, stores the new K/V
into this layer's KV pool at `batch.out_cache_loc` (one fused kernel), then lets the batch's
attention backend attend over the paged KV."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kernels import rotary


class PagedAttention(nn.Module):
    use_triton = False

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
        k_buffer, v_buffer = batch.attn_backend.kv_pool.get_kv(self.layer_id)
        rope = rotary.rope_and_store_kv if self.use_triton else rotary.rope_and_store_kv_reference
        q = rope(
            qkv, batch.positions, cos_sin_cache, k_buffer, v_buffer, batch.out_cache_loc,
            self.num_heads, self.num_kv_heads, q_norm, k_norm, eps,
        )  # fmt: skip
        return batch.attn_backend.forward(q, self, batch)
