"""The target on the training side: the server's own model class and weights, run densely and
frozen to give a draft its teacher signals. `Target.run(ids)` returns every position's final
hidden state and EAGLE-3 aux features, and logits and greedy choices only at the positions
asked for (those some draft step learns from).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gpu_worker.layers.layernorm import set_use_triton
from gpu_worker.layers.rotary import init_cos_sin_caches
from gpu_worker.models.config import ArchConfig, read_arch_config
from gpu_worker.models.registry import build_model, is_draft_architecture
from gpu_worker.weights import init_dummy_weights, load_weights
from training.dense import UnrolledAttention, dense_batch

# Positions the rotary caches cover: the longest training row plus the deepest unroll.
MAX_POSITIONS = 8192


def resolve_device(name: str) -> torch.device:
    """ "auto": the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclass
class TargetOutputs:
    hidden: torch.Tensor  # [B, T, H] after the final norm
    aux: torch.Tensor | None  # [B, T, len(aux_layers) * H]
    logits: torch.Tensor  # [N, V] float32 at the N positions asked for
    choice: torch.Tensor  # [N] int64 the target's greedy token there (argmax of logits)
    row: torch.Tensor  # [B * T] int64: flat position -> its row of logits (-1: not computed)

    def choice_at(self, index: torch.Tensor) -> torch.Tensor:
        """[m] flat positions (each one asked for) -> the target's greedy tokens [m]."""
        return self.choice[self.row[index]]


class Target:
    def __init__(
        self,
        model_dir: str,
        device: torch.device | str,
        dtype: torch.dtype,
        load_format: str = "auto",
    ) -> None:
        """load_format "dummy": random weights from config.json (to measure the tool's speed)."""
        self.model_dir = model_dir
        self.device, self.dtype = torch.device(device), dtype
        self.config: ArchConfig = read_arch_config(model_dir)
        if is_draft_architecture(self.config.architecture):
            raise ValueError(
                f"{model_dir!r} holds a draft ({self.config.architecture}), not a target"
            )
        self.model = build_model(self.config, self.device, dtype)
        if load_format == "dummy":
            init_dummy_weights(self.model, seed=0)
        else:
            load_weights(self.model, model_dir)
        init_cos_sin_caches(self.model, MAX_POSITIONS, self.device)
        set_use_triton(self.model, self.device.type == "cuda")

    @torch.no_grad()
    def run(
        self,
        ids: torch.Tensor,
        aux_layers: Sequence[int] = (),
        logits_at: torch.Tensor | None = None,
    ) -> TargetOutputs:
        """ids [B, T] int64 on the device -> hidden and aux of every position, logits and
        greedy choices where logits_at [B, T] bool says (None: everywhere)."""
        b, t = ids.shape
        positions = torch.arange(t, device=ids.device).expand(b, t)
        batch = dense_batch(ids, positions, UnrolledAttention(b, t))
        hidden, aux = self.model.model(batch, list(aux_layers))
        if logits_at is None:
            row = torch.arange(b * t, device=ids.device)
            logits = self.model.compute_logits(hidden)
        else:
            index = logits_at.reshape(-1).nonzero().squeeze(1)
            row = torch.full((b * t,), -1, dtype=torch.int64, device=ids.device)
            row[index] = torch.arange(len(index), device=ids.device)
            logits = self.model.compute_logits(hidden[index])
        shape = (b, t, -1)
        aux = None if aux is None else aux.reshape(shape)
        return TargetOutputs(hidden.reshape(shape), aux, logits, logits.argmax(-1), row)
