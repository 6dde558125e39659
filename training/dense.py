"""Dense forwards of the server's own models for training: rows of equal length, no KV pool.

The same modules the server runs (so a trained draft is exactly what it loads), over B rows x T
positions laid out flat, with `UnrolledAttention` as the backend: differentiable, and able to
run a draft several steps deep. Step i, query t attends step 0's keys [0..t] and the keys
position t produced at steps 1..i: what the serving draft loop attends after an extend at t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_worker.attention.base import AttentionLayer, RopeArgs
from gpu_worker.kernels.norm import rms_norm_reference
from gpu_worker.kernels.rotary import rotate_reference
from gpu_worker.step.forward_batch import SpecInput


@dataclass
class DenseBatch:
    """The part of `ForwardBatch` the models read, for B rows x T positions laid out flat."""

    input_ids: torch.Tensor  # [B * W] int64 (W = T, or a windowed step's width)
    positions: torch.Tensor  # [B * W] int64
    attn_backend: UnrolledAttention
    spec_info: SpecInput | None = None

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def split_rotate(
    qkv: torch.Tensor, layer: AttentionLayer, positions: torch.Tensor, rope: RopeArgs
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [n, (H + 2 KH) D] -> q [n, H, D], k [n, KH, D] (q/k-normed if asked, rotated at
    `positions`), v [n, KH, D]; the same arithmetic as the serving kernels' references."""
    n, d = qkv.shape[0], layer.head_dim
    kv_width = layer.num_kv_heads * d
    q, k, v = qkv.split([layer.num_heads * d, kv_width, kv_width], dim=-1)
    q, k = q.reshape(n, layer.num_heads, d), k.reshape(n, layer.num_kv_heads, d)
    if rope.q_norm is not None:
        q = rms_norm_reference(q, rope.q_norm, rope.eps)
        k = rms_norm_reference(k, rope.k_norm, rope.eps)
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    return rotate_reference(q, cos, sin), rotate_reference(k, cos, sin), v.reshape(n, -1, d)


class UnrolledAttention:
    """The attention backend of dense training forwards (see the module docstring).

    One instance serves one model over one batch: call the model for step 0, `next_step()`,
    call it again for step 1, and so on. It keeps each layer's keys of every step so far."""

    def __init__(self, batch_size: int, seq_len: int, later: torch.Tensor | None = None) -> None:
        """later: [B, W] the row positions steps >= 1 run at (None: every position, W = T)."""
        self.batch_size, self.seq_len = batch_size, seq_len
        self.later = later
        self.step = 0
        self._kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._masks: dict[int, torch.Tensor] = {}

    def next_step(self) -> None:
        self.step += 1

    def mask(self, step: int, device: torch.device) -> torch.Tensor:
        """[B or 1, 1, W, T + step W] bool, True = may attend: step 0's keys of positions <= the
        query's row position, then the diagonal of each later step's keys. Only the current
        step's is kept (a windowed batch's masks are per row)."""
        if step not in self._masks:
            self._masks.clear()
            t = self.seq_len
            later = self.later
            if later is None:
                later = torch.arange(t, device=device)[None, :]
            prefix = torch.arange(t, device=device)[None, None, :] <= later[:, :, None]
            diagonal = torch.eye(later.shape[1], dtype=torch.bool, device=device)
            diagonal = diagonal.repeat(1, step).expand(later.shape[0], -1, -1)
            self._masks[step] = torch.cat([prefix, diagonal], dim=2)[:, None]
        return self._masks[step]

    def attend(
        self, qkv: torch.Tensor, layer: AttentionLayer, batch: DenseBatch, rope: RopeArgs
    ) -> torch.Tensor:
        """qkv [B * W, (H + 2 KH) D] -> o [B * W, H * D] (W = T at step 0)."""
        b = self.batch_size
        w = qkv.shape[0] // b
        q, k, v = split_rotate(qkv, layer, batch.positions, rope)
        kv = self._kv.setdefault(layer.layer_id, [])
        if len(kv) != self.step:
            raise RuntimeError(
                f"layer {layer.layer_id} ran {len(kv)} times before step {self.step}"
            )

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [B * W, h, D] -> [B, h, W, D]
            return x.reshape(b, w, x.shape[1], x.shape[2]).transpose(1, 2)

        kv.append((heads_first(k), heads_first(v)))
        group = layer.num_heads // layer.num_kv_heads
        keys = torch.cat([k for k, _ in kv], dim=2).repeat_interleave(group, dim=1)
        values = torch.cat([v for _, v in kv], dim=2).repeat_interleave(group, dim=1)
        query = heads_first(q)
        if self.step == 0:
            o = F.scaled_dot_product_attention(
                query, keys, values, is_causal=True, scale=layer.scaling
            )
        else:
            mask = self.mask(self.step, qkv.device)
            o = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=mask, scale=layer.scaling
            )
        return o.transpose(1, 2).reshape(b * w, -1)  # [B * W, H * D]


def dense_batch(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    backend: UnrolledAttention,
    hidden: torch.Tensor | None = None,
) -> DenseBatch:
    """A DenseBatch from [B, T] ids and positions (and [B, T, H_in] hidden for a draft)."""
    spec = None if hidden is None else SpecInput(hidden.reshape(-1, hidden.shape[-1]))
    return DenseBatch(input_ids.reshape(-1), positions.reshape(-1), backend, spec)
