"""The EAGLE-3 recipe: one decoder layer over the target's aux features, unrolled `depth` steps
(training-time test), with its own LM head over a draft vocabulary of the most frequent
response tokens (`d2t` maps draft ids to target ids). See `training.recipes`."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from gpu_worker.models.config import arch_config_from_dict
from gpu_worker.models.llama_eagle3 import eagle3_aux_layer_ids
from training.recipes import (
    Recipe,
    StepOutput,
    checkpoint_tensors,
    draft_config,
    unroll_chain,
)
from training.rows import Rows
from training.target import Target, TargetOutputs

ARCHITECTURE = "LlamaForCausalLMEagle3"
STEP_DECAY = 0.8  # loss weight of step s is STEP_DECAY ** (s - 1)


class Eagle3Recipe(Recipe):
    name = "eagle3"
    architecture = ARCHITECTURE

    def __init__(
        self,
        target: Target,
        depth: int,
        seed: int,
        hot_ids: np.ndarray | None = None,
        init_from: str | None = None,
    ) -> None:
        """hot_ids: the draft vocabulary, target ids sorted ascending (a draft started from
        `init_from` keeps its own)."""
        super().__init__(target, depth, seed, init_from)
        tc = target.config
        if init_from is not None:
            self.config = self._init_config()
            self.aux_layers = eagle3_aux_layer_ids(self.config, tc.num_layers)
        else:
            assert hot_ids is not None, "a new EAGLE-3 draft needs its vocabulary"
            self.aux_layers = eagle3_aux_layer_ids({}, tc.num_layers)  # inputs of [2, L/2, L-3]
            self.config = draft_config(
                tc.raw,
                ARCHITECTURE,
                draft_vocab_size=len(hot_ids),
                target_hidden_size=tc.hidden_size,
                # config ids name layer OUTPUTS: the input of layer i is the output of layer i - 1
                eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.aux_layers]},
            )
        names = {"fc.weight", "lm_head.weight", "d2t"}  # own head and map; target embedding
        draft = self._build(arch_config_from_dict(self.config), tensor_names=names)
        if init_from is None:
            with torch.no_grad():
                hot = torch.as_tensor(np.asarray(hot_ids), dtype=torch.int64, device=self.device)
                draft.d2t.copy_(hot - torch.arange(len(hot), device=self.device))
                draft.lm_head.weight.copy_(target.model.lm_head.weight[hot].float())
        self.draft = self._attach(draft)
        self.modules = [self.draft]
        self.in_vocab = torch.zeros(tc.vocab_size, dtype=torch.bool, device=self.device)
        self.in_vocab[self.draft.hot_token_id] = True

    def step_weights(self) -> list[float]:
        return [STEP_DECAY**i for i in range(self.depth)]

    def unroll(
        self, rows: Rows, teacher: TargetOutputs, depth: int = 0, window: bool = False
    ) -> list[StepOutput]:
        assert teacher.aux is not None, "EAGLE-3 reads the target's aux features"
        return unroll_chain(self.draft, rows, teacher.aux, depth or self.depth, window)

    def teacher_distribution(self, teacher: TargetOutputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The target renormalised over the draft vocabulary; no loss where the target's own
        choice is outside it (no draft token could match)."""
        probs = F.softmax(teacher.logits[:, self.draft.hot_token_id], -1)
        return probs, self.in_vocab[teacher.choice]

    def predicted_ids(self, logits: torch.Tensor) -> torch.Tensor:
        return self.draft.hot_token_id[logits.argmax(-1)]

    def export_tensors(self) -> dict[str, torch.Tensor]:
        tensors = checkpoint_tensors(self.draft, self.target.model)
        tensors["t2d"] = self.in_vocab  # the reverse map, as the public format carries it
        return tensors

    def export_config(self) -> dict:
        return self.config
