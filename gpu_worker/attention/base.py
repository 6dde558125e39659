"""The attention backend interface and its registry.

A backend belongs to one ModelRunner. Per forward the runner calls
`init_forward_metadata(batch)` once, then each layer `attend(qkv, layer, batch, rope)`: RoPE
and the K/V store at `batch.out_cache_loc`, then attention over `req_to_token[row, :seq_len]`,
causal or through `batch.custom_mask` (tree-local `[bs, q_len, width]` over the last keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from gpu_worker.kv_cache import KVPool, ReqToTokenPool
from gpu_worker.step.forward_batch import ForwardBatch


class AttentionLayer(Protocol):
    """What a backend needs to know about the calling layer."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class RopeArgs:
    """What rotating q and k needs: the model's cos/sin cache [max_positions, head_dim] and,
    for Qwen3, the per-head q/k norm weights [head_dim] and their epsilon."""

    cos_sin_cache: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6


class AttentionBackend:
    """Base class; subclasses implement `init_forward_metadata`, `rope_and_store` and
    `forward`."""

    name = "base"
    # Plans its metadata on the device alone, so a graph captures `init_forward_metadata`
    # with the forward. Padded graph rows attend this many keys of row 0.
    supports_cuda_graph = False
    cuda_graph_seq_len_fill_value = 1
    # Whether metadata is planned from the host copies of the lengths (`seq_lens_cpu`); a
    # backend that plans on the device (False) gets placeholders there, so a step whose
    # lengths live on the device never waits for them.
    reads_host_lengths = True

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int) -> None:
        """num_heads: query heads of the model's attention layers."""
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool
        self.num_heads = num_heads

    def init_forward_metadata(self, batch: ForwardBatch) -> Any:
        """Plan this forward; returns the metadata `forward` reads (`batch.attn_metadata`)."""
        raise NotImplementedError

    def attend(
        self, qkv: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch, rope: RopeArgs
    ) -> torch.Tensor:
        """qkv `[num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]` (q, k, v heads) -> o
        `[num_tokens, num_heads * head_dim]` in qkv's dtype. Writes the new K/V to the pool."""
        k_buffer, v_buffer = self.kv_pool.get_kv(layer.layer_id)
        q = self.rope_and_store(
            qkv,
            batch.positions,
            rope.cos_sin_cache,
            k_buffer,
            v_buffer,
            batch.out_cache_loc,
            layer.num_heads,
            layer.num_kv_heads,
            rope.q_norm,
            rope.k_norm,
            rope.eps,
        )
        return self.forward(q, layer, batch)

    # rope_and_store(qkv, positions, cos_sin_cache, k_buffer, v_buffer, out_cache_loc,
    # num_heads, num_kv_heads, q_norm, k_norm, eps) -> q: see kernels.rotary.
    rope_and_store: Any = None

    def forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """q `[num_tokens, num_heads * head_dim]` (rotated) -> o `[num_tokens, num_heads *
        head_dim]` in q's dtype, over the KV already in the pool."""
        raise NotImplementedError


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls


def backend_class(name: str) -> type[AttentionBackend]:
    """The registered backend called name."""
    # Importing the implementations registers them.
    from gpu_worker.attention import torch_native, triton  # noqa: F401

    if name not in ATTENTION_BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; available: {sorted(ATTENTION_BACKENDS)}"
        )
    return ATTENTION_BACKENDS[name]


def create_attention_backend(
    name: str, req_to_token_pool: ReqToTokenPool, kv_pool: KVPool, num_heads: int
) -> AttentionBackend:
    return backend_class(name)(req_to_token_pool, kv_pool, num_heads)
