"""Projections, sharded over tensor-parallel ranks (`gpu_worker.parallel`).

`MergedLinear` (column-parallel) stacks projections of one input in one matrix (`qkv_proj`,
`gate_up_proj`); `RowParallelLinear` (o_proj, down_proj) sums its ranks' partial products in
`reduce`. Checkpoints keep the separate, unsharded HF names: each module lists the names it
loads (`checkpoint_loaders`) and copies this rank's slice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.parallel import TensorParallel

Loader = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class Shard:
    """One projection of a MergedLinear: the checkpoint tensor has `full_rows` rows, of which
    this rank keeps `rows` from `source_start`."""

    full_rows: int
    source_start: int
    rows: int

    @classmethod
    def heads(cls, first: int, count: int, total: int, head_dim: int) -> Shard:
        """Heads [first, first + count) of `total` heads of head_dim rows each."""
        return cls(total * head_dim, first * head_dim, count * head_dim)

    @classmethod
    def split(cls, full_rows: int, tp: TensorParallel, what: str) -> Shard:
        start, rows = tp.split(full_rows, what)
        return cls(full_rows, start, rows)


class MergedLinear(nn.Linear):
    def __init__(self, in_features: int, shards: dict[str, Shard], bias: bool) -> None:
        """shards: checkpoint module name -> its Shard, in output order."""
        super().__init__(in_features, sum(s.rows for s in shards.values()), bias=bias)
        self.shards = shards
        # Where each shard's rows lie in the merged parameter: (start, rows).
        self.shard_rows: dict[str, tuple[int, int]] = {}
        start = 0
        for name, shard in shards.items():
            self.shard_rows[name] = (start, shard.rows)
            start += shard.rows

    @torch.no_grad()
    def load_shard(self, shard: str, param_name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's rows of a checkpoint tensor (`weight` [full_rows, in] or `bias`
        [full_rows]) into the shard's rows."""
        start, rows = self.shard_rows[shard]
        source = self.shards[shard]
        param = getattr(self, param_name)
        expected = (source.full_rows, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"{shard}.{param_name} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        param[start : start + rows].copy_(tensor[source.source_start : source.source_start + rows])

    def checkpoint_loaders(self, path: str) -> dict[str, Loader]:
        """Checkpoint name -> loader, for the module at `path` (its shards are its siblings:
        `...self_attn.k_proj.weight` for `...self_attn.qkv_proj`)."""
        parent = path.rpartition(".")[0]
        prefix = f"{parent}." if parent else ""
        return {
            f"{prefix}{shard}.{param_name}": partial(self.load_shard, shard, param_name)
            for shard in self.shards
            for param_name, _ in self.named_parameters(recurse=False)
        }


class RowParallelLinear(nn.Linear):
    """A projection whose input is split over the ranks (each holds in_features / size
    columns of the weight, and of the activations it reads); `reduce` sums the partial
    outputs. The bias is added once: rank 0 holds it, the others hold zeros."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, tp: TensorParallel, what: str
    ) -> None:
        self.column_start, local = tp.split(in_features, what)
        super().__init__(local, out_features, bias=bias)
        self.tp, self.full_in_features = tp, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(F.linear(x, self.weight, self.bias))

    def reduce(self, partial_out: torch.Tensor) -> torch.Tensor:
        """Sum this rank's partial product with the other ranks' (identity at size 1)."""
        return self.tp.all_reduce(partial_out)

    @torch.no_grad()
    def load_weight(self, tensor: torch.Tensor) -> None:
        expected = (self.out_features, self.full_in_features)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"weight has shape {tuple(tensor.shape)}, expected {expected}")
        start = self.column_start
        self.weight.copy_(tensor[:, start : start + self.in_features])

    @torch.no_grad()
    def load_bias(self, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != (self.out_features,):
            raise ValueError(
                f"bias has shape {tuple(tensor.shape)}, expected ({self.out_features},)"
            )
        self.bias.copy_(tensor if self.tp.rank == 0 else torch.zeros_like(tensor))

    def checkpoint_loaders(self, path: str) -> dict[str, Loader]:
        loaders = {f"{path}.weight": self.load_weight}
        if self.bias is not None:
            loaders[f"{path}.bias"] = self.load_bias
        return loaders
