"""Rotary position embedding (rotate-half layout), with "default", "linear" and "llama3" scaling.

Holds no buffers: inverse frequencies are computed from a few scalars on the positions' device
each forward (once per model forward, shared by all layers), so the module works unchanged when
built on the meta device and materialised elsewhere, and inside CUDA graphs.
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta = rope_theta
        self.scaling = dict(rope_scaling or {})
        self.rope_type = self.scaling.get("rope_type") or self.scaling.get("type") or "default"
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope type {self.rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
            )

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies, scaled per rope type."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.rope_theta ** (exponents / self.head_dim))
        if self.rope_type == "linear":
            return inv_freq / self.scaling["factor"]
        if self.rope_type == "llama3":
            return scale_llama3(inv_freq, self.scaling)
        return inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] -> cos, sin [n, head_dim] float32 (each half repeated)."""
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def scale_llama3(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama-3.1 frequency scaling: long wavelengths divided by `factor`, short ones kept,
    a smooth blend in between (bounds at original_max_position_embeddings / *_freq_factor)."""
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context_len = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head_dim], cos/sin [n, head_dim] float32 -> rotated x in x's dtype."""
    x_float = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x_float[..., half:], x_float[..., :half]), dim=-1)
    return (x_float * cos[:, None, :] + rotated * sin[:, None, :]).to(x.dtype)
