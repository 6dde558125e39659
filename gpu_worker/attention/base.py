"""The attention backend interface and its registry.

A backend belongs to one ModelRunner and holds references to that runner's pools. Per forward
the runner calls `init_forward_metadata(batch)` once (host-side planning, index gathering),
then every attention layer calls `forward(q, k, v, layer, batch)`, which
1. stores the new k/v at `batch.out_cache_loc` in the KVPool (layer `layer.layer_id`), and
2. attends each request's queries over its KV `req_to_token[row, :seq_len]`: causal for the
   extend part (query j at position prefix + j sees keys 0..prefix + j), or through
   `batch.custom_mask` when it is set (tree verify).
"""

from __future__ import annotations

from typing import Protocol

import torch

from gpu_worker.forward_batch import ForwardBatch
from gpu_worker.kv_cache import KVPool, ReqToTokenPool


class AttentionLayer(Protocol):
    """What a backend needs to know about the calling layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


class AttentionBackend:
    """Base class; subclasses implement `init_forward_metadata` and `forward`."""

    name = "base"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Plan this forward; store the result in `batch.attn_metadata`."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q `[num_tokens, num_heads * head_dim]`, k/v `[num_tokens, num_kv_heads * head_dim]`
        -> o `[num_tokens, num_heads * head_dim]` in q's dtype. Writes k/v into the KV pool."""
        raise NotImplementedError


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def create_attention_backend(
    name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool
) -> AttentionBackend:
    # Importing the implementations registers them.
    from gpu_worker.attention import torch_native  # noqa: F401

    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name](req_to_token_pool, kv_pool)
