"""The attention backend interface and its registry.

A backend belongs to one ModelRunner and holds references to that runner's pools. Per forward
the runner calls `init_forward_metadata(batch)` once, then every attention layer (which has
already stored the new tokens' K/V at `batch.out_cache_loc` in the KV pool, fused with RoPE)
calls `forward(q, layer, batch)`, which attends each request's queries over its KV
`req_to_token[row, :seq_len]`: causal for the extend part (query j at position prefix + j sees
keys 0..prefix + j), or through `batch.custom_mask` when it is set: a tree-local
`[bs, q_len, width]` mask over each request's last `width` keys, every earlier key visible
(tree verify: width ND; multi-step draft decode: width topk * S, the branch-local keys).

CUDA-graph hooks (backends with `supports_cuda_graph`): `init_cuda_graph_state(max_bs,
max_tokens_per_req)` allocates whatever the backend keeps across replays, once;
`init_forward_metadata_capture(batch)` prepares metadata for a capture (the batch's tensors are
the graph's static buffers) and `init_forward_metadata_replay(batch)` refreshes it in place
before a replay, reading only device tensors. Padded rows of a graph batch point at request row
0 and slot 0 with `cuda_graph_seq_len_fill_value` keys.
"""

from __future__ import annotations

from typing import Any, Protocol

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
    """Base class; subclasses implement `init_forward_metadata` and `forward` (and the graph
    hooks when `supports_cuda_graph`)."""

    name = "base"
    supports_cuda_graph = False
    cuda_graph_seq_len_fill_value = 1

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int) -> None:
        """num_heads: query heads of the model's attention layers."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.num_heads = num_heads

    def init_forward_metadata(self, batch: ForwardBatch) -> Any:
        """Plan this forward; returns the metadata `forward` reads (`batch.attn_metadata`)."""
        raise NotImplementedError

    def forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """q `[num_tokens, num_heads * head_dim]` -> o `[num_tokens, num_heads * head_dim]` in
        q's dtype, over the KV already in the pool."""
        raise NotImplementedError

    def init_cuda_graph_state(self, max_bs: int, max_tokens_per_req: int) -> None:
        raise NotImplementedError(f"{self.name} cannot run in CUDA graphs")

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> Any:
        raise NotImplementedError(f"{self.name} cannot run in CUDA graphs")

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> Any:
        raise NotImplementedError(f"{self.name} cannot run in CUDA graphs")


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def create_attention_backend(
    name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int
) -> AttentionBackend:
    # Importing the implementations registers them.
    from gpu_worker.attention import torch_native, triton  # noqa: F401

    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name](req_to_token_pool, kv_pool, num_heads)
