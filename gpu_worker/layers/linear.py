"""`MergedLinear`: several projections of the same input in one matrix (one GEMM launch).

`qkv_proj` stacks q_proj, k_proj and v_proj on the output dimension, `gate_up_proj` stacks
gate_proj and up_proj. Checkpoints keep the separate Hugging Face names: the weight loader
finds, for a tensor named `....self_attn.k_proj.weight`, the MergedLinear beside it that has a
shard `k_proj`, and copies the tensor into that shard's rows (`load_shard`).
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        """shards: checkpoint module name -> output rows, in output order."""
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for name, rows in shards.items():
            self.shard_rows[name] = (start, rows)
            start += rows

    @torch.no_grad()
    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor (`weight` [rows, in] or `bias` [rows]) into its rows."""
        start, rows = self.shard_rows[shard]
        param = getattr(self, param_name)
        expected = (rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{shard}.{param_name} has shape {tuple(tensor.shape)}, "
                             f"expected {expected}")  # fmt: skip
        param[start : start + rows].copy_(tensor)
