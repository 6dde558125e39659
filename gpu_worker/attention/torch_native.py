"""`torch_native`: obviously correct paged attention with torch ops, the reference every other
backend is tested against. Per request it gathers K/V through req_to_token and calls SDPA with
an explicit boolean mask; a batch of one query per request takes one padded SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionBackend, AttentionLayer, register_backend
from gpu_worker.kernels.rotary import rope_and_store_kv_reference
from gpu_worker.step.forward_batch import ForwardBatch


@dataclass
class RequestView:
    """One request's share of the batch: its tokens, its KV slots and its mask."""

    token_start: int
    extend_len: int
    slots: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor  # [extend_len, seq_len] bool, True = may attend


def build_causal_mask(committed_len: int, extend_len: int, device: torch.device) -> torch.Tensor:
    """[extend_len, committed_len + extend_len] bool: query j sees keys 0..committed_len + j."""
    keys = torch.arange(committed_len + extend_len, device=device)
    queries = torch.arange(extend_len, device=device) + committed_len
    return keys[None, :] <= queries[:, None]


def expand_custom_mask(custom: torch.Tensor, seq_len: int) -> torch.Tensor:
    """A tree-local mask [q_len, width] over the last `width` of seq_len keys -> the full
    [q_len, seq_len] bool mask (every earlier key is visible)."""
    q_len, width = custom.shape
    prefix = torch.ones(q_len, seq_len - width, dtype=torch.bool, device=custom.device)
    return torch.cat((prefix, custom.to(torch.bool)), dim=1)


@dataclass
class DecodeView:
    """The whole batch at once when each request runs one query without a custom mask."""

    slots: torch.Tensor  # [bs, max_seq_len] int64, padded past each seq_len
    mask: torch.Tensor  # [bs, 1, 1, max_seq_len] bool, True = a real key


def build_decode_view(batch: ForwardBatch, req_to_token: torch.Tensor) -> DecodeView:
    max_seq_len = max(batch.seq_lens_cpu)
    slots = req_to_token[batch.rows, :max_seq_len].long()
    keys = torch.arange(max_seq_len, device=slots.device)
    mask = keys[None, :] < batch.seq_lens.to(slots.device)[:, None]
    return DecodeView(slots, mask[:, None, None, :])


@register_backend
class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    rope_and_store = staticmethod(rope_and_store_kv_reference)

    def init_forward_metadata(self, batch: ForwardBatch) -> DecodeView | list[RequestView]:
        req_to_token = self.req_to_token_pool.req_to_token
        if batch.custom_mask is None and all(n == 1 for n in batch.extend_seq_lens_cpu):
            return build_decode_view(batch, req_to_token)
        device = req_to_token.device
        rows = batch.rows.tolist()
        views = []
        token_start = 0
        for i, (row, seq_len, extend_len) in enumerate(
            zip(rows, batch.seq_lens_cpu, batch.extend_seq_lens_cpu, strict=True)
        ):
            committed_len = seq_len - extend_len
            if batch.custom_mask is None:
                mask = build_causal_mask(committed_len, extend_len, device)
            else:
                mask = expand_custom_mask(batch.custom_mask[i], seq_len)
            slots = req_to_token[row, :seq_len].long()
            views.append(RequestView(token_start, extend_len, slots, mask))
            token_start += extend_len
        return views

    def forward(self, q: torch.Tensor, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        num_tokens = q.shape[0]
        k_buffer, v_buffer = self.kv_pool.get_kv(layer.layer_id)
        q = q.view(num_tokens, layer.num_heads, layer.head_dim)
        if isinstance(batch.attn_metadata, DecodeView):
            return attend_decode(q, k_buffer, v_buffer, batch.attn_metadata, layer.scaling)
        o = torch.empty_like(q)
        for view in batch.attn_metadata:
            end = view.token_start + view.extend_len
            o[view.token_start : end] = attend(
                q[view.token_start : end],
                k_buffer[view.slots],
                v_buffer[view.slots],
                view.mask,
                layer.scaling,
            )
        return o.view(num_tokens, layer.num_heads * layer.head_dim)


def attend_decode(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    view: DecodeView,
    scaling: float,
) -> torch.Tensor:
    """q [bs, heads, d] (one query per request) -> o [bs, heads * d]."""
    k = k_buffer[view.slots].transpose(1, 2).to(q.dtype)  # [bs, kv_heads, max_seq_len, d]
    v = v_buffer[view.slots].transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(
        q[:, :, None, :], k, v, attn_mask=view.mask, scale=scaling, enable_gqa=True
    )  # [bs, heads, 1, d]
    return o.reshape(q.shape[0], -1)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scaling: float
) -> torch.Tensor:
    """q [extend_len, heads, d], k/v [seq_len, kv_heads, d], mask [extend_len, seq_len]
    -> [extend_len, heads, d]. Grouped-query: each kv head serves heads // kv_heads heads."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return o.transpose(0, 1)  # [extend_len, heads, d]
