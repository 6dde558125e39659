"""What each kind of draft learns: the `Recipe` base of EAGLE-3, EAGLE and MTP (`eagle3`,
`eagle`, `mtp`). A recipe builds the draft from the server's own module classes, runs it
`depth` steps deep against the target's teacher signals, returns each step's logits and
learning positions, and exports the draft in the format the server loads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.layers.layernorm import set_use_triton
from gpu_worker.layers.linear import MergedLinear
from gpu_worker.layers.rotary import init_cos_sin_caches
from gpu_worker.models.config import ArchConfig
from gpu_worker.models.registry import build_model
from gpu_worker.weights import init_dummy_weights, load_weights
from training.dense import UnrolledAttention, dense_batch
from training.rows import Rows
from training.soft_ce import soft_cross_entropy
from training.target import MAX_POSITIONS, Target, TargetOutputs

# Target config keys a one-layer Llama draft copies (its shapes, vocabulary and rotary settings).
_DRAFT_CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
)
EXPORT_DTYPE = torch.bfloat16
MAX_SHARD_BYTES = 15 * 2**20  # each exported file stays under 16 MiB


@dataclass
class StepOutput:
    """One draft step over a batch, laid out [B * W]: every row position (W = T), or a
    windowed step's row positions (`unroll_chain`). Logits are computed only where needed:
    `logits(index)`."""

    hidden: torch.Tensor  # [B * W, H] the draft's output (its pass-back hidden)
    head: Callable[[torch.Tensor], torch.Tensor]  # hidden [m, H] -> logits [m, V_draft] f32
    learns: torch.Tensor  # [B * W] bool
    # [B * W] flat index of the teacher position u = t + s (into `teacher.hidden`, [B * T];
    # `teacher.row` maps it to the rows of the teacher's logits)
    teacher_index: torch.Tensor

    def logits(self, index: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden[index])


def draft_config(target_config: dict, architecture: str, **extra) -> dict:
    """A one-layer Llama-shaped draft config with the target's shapes and vocabulary."""
    config = {k: target_config[k] for k in _DRAFT_CONFIG_KEYS if target_config.get(k) is not None}
    heads = target_config["num_attention_heads"]
    config.setdefault("head_dim", target_config["hidden_size"] // heads)
    config.update(
        architectures=[architecture],
        model_type="llama",
        num_hidden_layers=1,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    return {**config, **extra}


def teacher_index(rows: Rows, shift: int, at: torch.Tensor | None = None) -> torch.Tensor:
    """[B * W] flat index of position t + shift in the same row (clamped inside the row), at
    the row positions `at` [B, W] (default: every position)."""
    b, t = rows.shape
    u = (rows.positions() if at is None else at) + shift
    return (u.clamp(max=t - 1) + torch.arange(b, device=u.device)[:, None] * t).reshape(-1)


def unroll_chain(
    draft: nn.Module, rows: Rows, hidden: torch.Tensor, depth: int, window: bool = False
) -> list[StepOutput]:
    """A one-layer draft `depth` steps deep (the training-time test): step 1 at row position t reads
    ids[t + 1] and `hidden` [B, T, H_in] at t, step s > 1 reads ids[t + s] and the draft's own
    output of step s - 1, at position t + s - 1, attending to step 1's keys of positions <= t
    and to its own earlier steps at t (`UnrolledAttention`): the serving draft loop's inputs
    after a verified prefix ending at t, for as long as its proposals are right.

    Step 1 runs over every position (its keys are every later step's prefix). With `window`,
    steps 2..depth run only over `Rows.window(depth)`, where they can learn: the same losses
    at every position that learns, without the prompt positions (over half of the tokens of
    chat data). Their `StepOutput`s are then laid out [B * W], not [B * T]."""
    b, t = rows.shape
    later = rows.window(depth) if window else None
    backend = UnrolledAttention(b, t, later)
    at = rows.positions()
    outs = []
    for i in range(depth):
        shift = i + 1
        if i == 1 and later is not None:
            at = later
            hidden = hidden.gather(1, at[:, :, None].expand(-1, -1, hidden.shape[-1]))
        batch = dense_batch(rows.shifted_ids(shift, at), at + i, backend, hidden)
        h = draft(batch)  # [B * W, H]
        outs.append(
            StepOutput(
                h,
                draft.compute_logits,
                rows.learns(shift, at).reshape(-1),
                teacher_index(rows, shift, at),
            )
        )
        hidden = h.reshape(b, at.shape[1], -1)
        backend.next_step()
    return outs


class Recipe:
    """Base: a draft module (or several), trained `depth` steps deep against a target (an
    EAGLE draft's unrolled steps, or the number of MTP layers)."""

    name = "?"

    architecture = "?"  # what the exported config.json names

    def __init__(self, target: Target, depth: int, seed: int, init_from: str | None = None) -> None:
        """init_from: an exported draft of this kind to start from (its weights, config and,
        for EAGLE-3, its vocabulary); None starts from random weights."""
        self.target, self.depth, self.seed, self.init_from = target, depth, seed, init_from
        self.device = target.device
        if init_from is not None:
            found = (self._init_config().get("architectures") or ["?"])[0]
            if found != self.architecture:
                raise ValueError(
                    f"{init_from} holds a {found} draft; the {self.name} recipe "
                    f"needs a {self.architecture} one"
                )

    # ------------------------------------------------------------------ subclasses provide
    modules: list[nn.Module]
    aux_layers: list[int] = []

    def unroll(
        self, rows: Rows, teacher: TargetOutputs, depth: int = 0, window: bool = False
    ) -> list[StepOutput]:
        """The draft's first `depth` steps (0: all) over the rows; with `window`, an unrolled
        chain's later steps only where they can learn (`unroll_chain`)."""
        raise NotImplementedError

    def teacher_distribution(
        self, teacher: TargetOutputs
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's distribution over the draft head's outputs at the positions it computed
        logits for, [N, V_draft] (rows as `teacher.logits`), and [N] bool: where a draft token
        can match the target's choice (None: everywhere). Default: the full vocabulary."""
        return F.softmax(teacher.logits, -1), None

    def step_loss(
        self,
        out: StepOutput,
        teacher: TargetOutputs,
        where: torch.Tensor,
        logits: torch.Tensor,
        probs: torch.Tensor,
        at: torch.Tensor,
    ) -> torch.Tensor:
        """[m] loss at the learning positions `where` [m] of one step, whose draft logits
        are `logits` [m, V_draft]; the teacher's distribution there is `probs[at]` (probs
        [N, V_draft] as `teacher_distribution` gives it). Default: soft cross-entropy."""
        return soft_cross_entropy(logits, probs, at)

    def predicted_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, V_draft] -> target token ids [n]."""
        return logits.argmax(-1)

    def export_tensors(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def export_config(self) -> dict:
        raise NotImplementedError

    def step_weights(self) -> list[float]:
        return [1.0] * self.depth

    # ------------------------------------------------------------------ shared
    training = True  # EAGLE's input noise is on while training, off for the estimate

    def _build(
        self, config: ArchConfig, what: str | None = None, seed_offset: int = 0, **options
    ) -> nn.Module:
        """A draft module of `config`, float32, loaded from `init_from` or randomly initialised
        (matrices N(0, 0.02) from seed + seed_offset, norms 1), before `attach_target`. what:
        the module, in errors."""
        module = build_model(config, self.device, torch.float32, **options)
        if self.init_from is None:
            init_dummy_weights(module, self.seed + seed_offset)
        else:
            load_weights(module, self.init_from, what)
        return module

    def _init_config(self) -> dict:
        """config.json of `init_from`."""
        assert self.init_from is not None
        with open(os.path.join(self.init_from, "config.json")) as f:
            return json.load(f)

    def _attach(self, module: nn.Module) -> nn.Module:
        """Share the target's modules (frozen), make the draft's own weights trainable."""
        module.attach_target(self.target.model)
        init_cos_sin_caches(module, MAX_POSITIONS, self.device)
        set_use_triton(module, False)
        shared = {id(p) for p in self.target.model.parameters()}
        for p in module.parameters():
            p.requires_grad_(id(p) not in shared and p.is_floating_point())
        return module

    def parameters(self) -> list[nn.Parameter]:
        return [p for m in self.modules for p in m.parameters() if p.requires_grad]

    def losses(
        self, rows: Rows, teacher: TargetOutputs, window: bool = True
    ) -> tuple[torch.Tensor, dict]:
        """The weighted loss over all steps (None when no position of the batch learns), and
        per-step loss and accuracy (the draft's choice equals the target's); `window`: see
        `unroll_chain` (the same values either way)."""
        total = None
        per_step = torch.zeros(2, self.depth, device=self.device)  # loss, accuracy
        missing = torch.zeros((), dtype=torch.bool, device=self.device)  # a row not computed
        probs, reachable = self.teacher_distribution(teacher)
        outs = self.unroll(rows, teacher, window=window)
        for s, (out, weight) in enumerate(zip(outs, self.step_weights(), strict=True)):
            where = out.learns.nonzero().squeeze(1)
            if where.numel() == 0:
                continue
            logits = out.logits(where)  # [m, V_draft]
            at = teacher.row[out.teacher_index[where]]  # [m] rows of teacher logits, probs, choice
            missing |= (at < 0).any()
            # a missing row (-1) raises below; until then read row 0, not before the tensor
            loss = self.step_loss(out, teacher, where, logits, probs, at.clamp(min=0))
            if reachable is not None:
                loss = loss * reachable[at]
            loss = loss.mean()  # over the m positions
            total = weight * loss if total is None else total + weight * loss
            chosen = self.predicted_ids(logits.detach())
            per_step[0, s] = loss.detach()
            per_step[1, s] = (chosen == teacher.choice[at]).float().mean()
        d = self.depth
        values = torch.cat([per_step.reshape(-1), missing.float().reshape(1)]).tolist()  # one sync
        if values[-1]:
            raise RuntimeError(
                "a learning position has no teacher logits: the target must "
                "compute them at every Rows.teaches() position"
            )
        return total, {"loss": values[:d], "acc": values[d : 2 * d]}

    @torch.no_grad()
    def chain_agreement(self, rows: Rows, teacher: TargetOutputs, depth: int) -> torch.Tensor:
        """agree [depth, B * T] bool: whether step s of a chain after a verified prefix ending
        at t picks the target's greedy token, where all `depth` steps have a token to compare
        with (False elsewhere). On the target's own greedy continuations the teacher-forced
        inputs are what the serving chain feeds itself while it is right, so walking these
        gives the chain's accept lengths (`training.estimate`)."""
        outs = self.unroll(rows, teacher, depth)
        whole = torch.stack([o.learns for o in outs]).all(0)
        where = whole.nonzero().squeeze(1)
        agree = torch.zeros(len(outs), whole.numel(), dtype=torch.bool, device=whole.device)
        for s, o in enumerate(outs):
            chosen = self.predicted_ids(o.logits(where))
            agree[s, where] = chosen == teacher.choice_at(o.teacher_index[where])
        return agree

    def export(self, out_dir: str) -> None:
        """Write config.json and bf16 safetensors (sharded under 16 MiB per file) that the
        server loads as `--speculative-draft-model-path out_dir`."""
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        tensors = {
            k: (v.to(EXPORT_DTYPE) if v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in self.export_tensors().items()
        }
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name in sorted(tensors):
            nbytes = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensors[name]
            size += nbytes
        for old in os.listdir(out_dir):
            if old.endswith(".safetensors") or old.endswith(".index.json"):
                os.remove(os.path.join(out_dir, old))
        if len(shards) == 1:
            save_file(shards[0], os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, os.path.join(out_dir, file), {"format": "pt"})
                weight_map.update(dict.fromkeys(shard, file))
            with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(self.export_config(), f, indent=2)


def checkpoint_tensors(module: nn.Module, target: nn.Module, rename=lambda n: n) -> dict:
    """module's own tensors under checkpoint names: merged projections split back into their
    Hugging Face shards (q/k/v, gate/up), the target's shared modules left out."""
    shared = {id(p) for p in target.parameters()}
    merged = {path: m for path, m in module.named_modules() if isinstance(m, MergedLinear)}
    out: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if id(param) in shared:
            continue
        parent, _, kind = name.rpartition(".")
        if parent in merged:
            grand = parent.rpartition(".")[0]
            for shard, (start, rows) in merged[parent].shard_rows.items():
                out[rename(f"{grand}.{shard}.{kind}" if grand else f"{shard}.{kind}")] = param[
                    start : start + rows
                ]
            continue
        out[rename(name)] = param
    return out


def draft_vocabulary(token_counts: np.ndarray, size: int) -> np.ndarray:
    """The `size` most frequent token ids (ties: lower id first), sorted by id."""
    order = np.lexsort((np.arange(len(token_counts)), -token_counts))
    return np.sort(order[:size])
