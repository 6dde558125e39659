"""`KVPool`: one runner's physical K and V buffers, one pair per layer, addressed by slot id.

All layers' K and V live in ONE tensor `[2, num_layers, slots, kv_heads, head_dim]` (the
per-layer buffers are views of it), so moving slots in every layer at once (accepted-path
compaction after a tree verify) is a single gather and scatter, not four kernels per layer."""

from __future__ import annotations

import torch


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K + V one token occupies across all layers."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * element_size


class KVPool:
    """Per-layer K/V buffers `[num_slots + page_size, num_kv_heads, head_dim]`.

    Slots 0..page_size-1 (page 0) are reserved dummies; the scheduler allocates slots
    page_size..num_slots + page_size - 1, so `num_slots` usable slots (a multiple of page_size).
    Several runners (target, drafts) keep separate pools addressed by the same slot ids.
    """

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
        self.num_slots = num_slots
        self.page_size = page_size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (2, num_layers, num_slots + page_size, num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_buffers = list(self.kv[0].unbind(0))
        self.v_buffers = list(self.kv[1].unbind(0))

    def get_kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffers[layer_id], self.v_buffers[layer_id]

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v `[n, num_kv_heads, head_dim]` at slots loc `[n]` of one layer (in place)."""
        self.k_buffers[layer_id][loc] = k.to(self.dtype)
        self.v_buffers[layer_id][loc] = v.to(self.dtype)

    def move_kv(self, dst_loc: torch.Tensor, src_loc: torch.Tensor) -> None:
        """Copy K/V of slots src_loc `[n]` to dst_loc `[n]` in every layer (in place).

        Sources are read before any destination is written, so the two may overlap. One
        gather and one scatter over the whole pool, whatever the number of layers.
        """
        self.kv[:, :, dst_loc] = self.kv[:, :, src_loc]

    def bytes_per_token(self) -> int:
        k = self.k_buffers[0]
        return kv_bytes_per_token(self.num_layers, k.shape[1], k.shape[2], self.dtype)
