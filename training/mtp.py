"""The MTP recipe: `num_layers` MTP layers in MiMo's layout, all trained in one teacher-forced
pass. Layer k at position t reads the target's hidden state at t and the token at t + 1 + k,
and learns the target's distribution at t + 1 + k (it predicts token t + 2 + k), through the
target's LM head. Exported as a directory the server's `--speculative-algorithm MTP` loads:
the target's config.json with `num_nextn_predict_layers` and `model.mtp_layers.{k}.*`
tensors. See `training.recipes`."""

from __future__ import annotations

import torch

from gpu_worker.models.config import arch_config_from_dict
from gpu_worker.models.mimo_mtp import mtp_arch_config
from training.dense import UnrolledAttention, dense_batch
from training.recipes import (
    Recipe,
    StepOutput,
    checkpoint_tensors,
    teacher_index,
)
from training.rows import Rows
from training.target import Target, TargetOutputs

# Per-layer loss weights for three layers (FastMTP's); other depths decay by the same ratio.
THREE_LAYER_WEIGHTS = (0.51, 0.31, 0.18)


class MTPRecipe(Recipe):
    name = "mtp"

    def __init__(self, target: Target, depth: int, seed: int, init_from: str | None = None) -> None:
        """depth: the number of MTP layers (init_from: MTP layers to start from, at least as
        many). Each layer starts from its own random weights."""
        self.architecture = target.config.architecture  # MTP layers ship in the target's format
        super().__init__(target, depth, seed, init_from)
        if init_from is not None:
            have = int(self._init_config().get("num_nextn_predict_layers") or 0)
            if depth > have:
                raise ValueError(
                    f"{init_from} holds {have} MTP layers: use a depth of at most {have}"
                )
        self.config = {
            **target.config.raw,
            "num_nextn_predict_layers": depth,
            "torch_dtype": "bfloat16",
        }
        arch = arch_config_from_dict(self.config)
        self.layers = [
            self._attach(
                self._build(mtp_arch_config(arch, k), f"MTP layer {k}", seed_offset=k, mtp_layer=k)
            )
            for k in range(depth)
        ]
        self.modules = self.layers

    def step_weights(self) -> list[float]:
        if self.depth == len(THREE_LAYER_WEIGHTS):
            return list(THREE_LAYER_WEIGHTS)
        ratio = THREE_LAYER_WEIGHTS[1] / THREE_LAYER_WEIGHTS[0]
        weights = [ratio**k for k in range(self.depth)]
        return [w / sum(weights) for w in weights]

    def unroll(
        self, rows: Rows, teacher: TargetOutputs, depth: int = 0, window: bool = False
    ) -> list[StepOutput]:
        """Every layer over every position (`window` is ignored): each attends causally to
        its own keys of the whole row."""
        b, t = rows.shape
        outs = []
        for k, layer in enumerate(self.layers[: depth or self.depth]):
            shift = k + 1
            batch = dense_batch(
                rows.shifted_ids(shift), rows.positions(), UnrolledAttention(b, t), teacher.hidden
            )
            out = layer(batch)  # [B * T, H]
            outs.append(
                StepOutput(
                    out,
                    layer.compute_logits,
                    rows.learns(shift).reshape(-1),
                    teacher_index(rows, shift),
                )
            )
        return outs

    def export_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for k, layer in enumerate(self.layers):
            prefix = f"model.mtp_layers.{k}."
            tensors.update(
                checkpoint_tensors(
                    layer, self.target.model, lambda n, p=prefix: p + n.removeprefix("block.")
                )
            )
        return tensors

    def export_config(self) -> dict:
        return self.config
