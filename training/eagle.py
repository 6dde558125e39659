"""The EAGLE (EAGLE-1) recipe: `fc(cat(embed, feature))` and one decoder layer, reading the
target's final hidden state and regressing the next one, through the target's own LM head.
Uniform noise on the input feature while training; unrolled `depth` steps like EAGLE-3 (one
step is the original recipe). See `training.recipes`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_worker.models.config import arch_config_from_dict
from training.recipes import (
    Recipe,
    StepOutput,
    checkpoint_tensors,
    draft_config,
    unroll_chain,
)
from training.rows import Rows
from training.soft_ce import soft_cross_entropy
from training.target import Target, TargetOutputs

ARCHITECTURE = "LlamaForCausalLMEagle"
NOISE = 0.1  # input feature noise ~ U(-NOISE, NOISE)
TOKEN_LOSS_WEIGHT = 0.1


class EagleRecipe(Recipe):
    name = "eagle"
    architecture = ARCHITECTURE

    def __init__(self, target: Target, depth: int, seed: int, init_from: str | None = None) -> None:
        super().__init__(target, depth, seed, init_from)
        if init_from is not None:
            self.config = self._init_config()
        else:
            self.config = draft_config(target.config.raw, ARCHITECTURE)
        self.draft = self._attach(self._build(arch_config_from_dict(self.config)))
        self.modules = [self.draft]

    def unroll(
        self, rows: Rows, teacher: TargetOutputs, depth: int = 0, window: bool = False
    ) -> list[StepOutput]:
        hidden = teacher.hidden
        if self.training:
            hidden = hidden + torch.empty_like(hidden).uniform_(-NOISE, NOISE)
        return unroll_chain(self.draft, rows, hidden, depth or self.depth, window)

    def step_loss(
        self,
        out: StepOutput,
        teacher: TargetOutputs,
        where: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        at: torch.Tensor,
    ) -> torch.Tensor:
        """SmoothL1 to the target's hidden state at the position the step predicts from, plus
        TOKEN_LOSS_WEIGHT x soft cross-entropy against the target's distribution there."""
        index = out.teacher_index[where]
        feature = teacher.hidden.reshape(-1, teacher.hidden.shape[-1])[index].float()
        regression = F.smooth_l1_loss(out.hidden[where].float(), feature, reduction="none")
        return regression.mean(-1) + TOKEN_LOSS_WEIGHT * soft_cross_entropy(logits, probs, at)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        return checkpoint_tensors(self.draft, self.target.model)

    def export_config(self) -> dict:
        return self.config
