"""`PagedAttention`: the layer-side handle of attention. It owns no weights; it forwards q/k/v
to the batch's attention backend, which stores the new K/V and attends over the paged KV."""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.forward_batch import ForwardBatch


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
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q [n, heads * d], k/v [n, kv_heads * d] -> o [n, heads * d]."""
        return batch.attn_backend.forward(q, k, v, self, batch)
