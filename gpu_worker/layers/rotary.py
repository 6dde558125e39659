"""Rotary position embedding (rotate-half layout), with "default", "linear" and "llama3" scaling.

`build_cos_sin_cache(max_positions, device)` computes the angles of every position once:
[max_positions, head_dim] float32, cos in the first head_dim/2 columns and sin in the last
(each frequency once). The runner builds it after the weights are on the device
(`init_cos_sin_cache`); attention reads rows of it by position (`kernels.rotary`).
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
        # [max_positions, head_dim] float32, set by init_cos_sin_cache (not a parameter or a
        # buffer: the model is built on the meta device and this is derived, never loaded).
        self.cos_sin_cache: torch.Tensor | None = None

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies, scaled per rope type."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.rope_theta ** (exponents / self.head_dim))
        if self.rope_type == "linear":
            return inv_freq / self.scaling["factor"]
        if self.rope_type == "llama3":
            return scale_llama3(inv_freq, self.scaling)
        return inv_freq

    def build_cos_sin_cache(self, max_positions: int, device: torch.device) -> torch.Tensor:
        """[max_positions, head_dim] float32: cos | sin of position * inv_freq."""
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * self.inv_freq(device)[None, :]  # [max_positions, D/2]
        return torch.cat((freqs.cos(), freqs.sin()), dim=-1)

    def init_cos_sin_cache(self, max_positions: int, device: torch.device) -> None:
        self.cos_sin_cache = self.build_cos_sin_cache(max_positions, device)


def init_cos_sin_caches(model: nn.Module, max_positions: int, device: torch.device) -> None:
    """Build the cos/sin cache of every RotaryEmbedding in model (once, after loading)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_cos_sin_cache(max_positions, device)


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
