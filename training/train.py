"""The training loop: batches, teacher signals, the recipe's loss, AdamW (warm-up, cosine decay),
evaluation, and checkpoints that resume. The output directory holds `draft/` (the export),
`state.pt` (`--resume` continues from it) and `train_log.jsonl`. A run stopped by its time or
step limit leaves a state and a draft, and resuming computes what an uninterrupted run would.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from training.build import build_recipe, split_indices
from training.estimate import DEFAULT_ESTIMATE_DEPTH, describe_estimate, estimate_accept_length
from training.rows import Rows, epoch_order, length_batches, make_rows
from training.target import MAX_POSITIONS, Target, resolve_device
from training.tokens import TokenFile


@dataclass
class TrainConfig:
    algorithm: str  # eagle3 | eagle | mtp
    model: str
    data: str
    out: str
    depth: int = 0  # draft steps unrolled (MTP: layers); 0 = the algorithm's default
    epochs: float = 1.0
    total_steps: int = 0  # the run's length in optimiser steps; 0 = from epochs
    lr: float = 1e-4
    warmup: float = 0.015  # fraction of the run
    clip: float = 0.5
    tokens_per_batch: int = 16384
    max_len: int = 2048
    draft_vocab: int = 8192  # EAGLE-3
    init_from: str = ""  # an exported draft to start from (default: random weights)
    max_minutes: float = 0.0  # 0 = no limit; stop (resumably) when this call has run so long
    max_steps: int = 0  # 0 = no limit; stop (resumably) after this many steps in this call
    log_every: int = 20
    eval_every: int = 500
    seed: int = 0
    device: str = "auto"
    load_format: str = "auto"  # dummy: random target weights (to measure the tool's speed)
    resume: bool = False

    # What a resumed run must share with the run it continues (its data is checked too).
    RESUMED = (
        "algorithm",
        "model",
        "depth",
        "epochs",
        "total_steps",
        "lr",
        "warmup",
        "clip",
        "tokens_per_batch",
        "max_len",
        "draft_vocab",
        "init_from",
        "seed",
    )

    def check(self) -> None:
        for name in ("log_every", "eval_every", "tokens_per_batch", "max_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive")
        if self.max_len + self.depth + 1 > MAX_POSITIONS:
            raise ValueError(
                f"--max-len {self.max_len} is too long: rows and their draft steps "
                f"must fit {MAX_POSITIONS} positions"
            )


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    """The learning rate of optimiser step `step` of `total`: linear warm-up over the first
    `warmup` fraction, then a cosine decay to zero."""
    warmup = max(1, int(cfg.warmup * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def shared_tensors(module: torch.nn.Module, target: Target) -> set[str]:
    """Names in module's state dict that are the target's tensors (frozen, never saved)."""
    ours = {id(p) for p in target.model.parameters()}
    return {k for k, v in module.state_dict(keep_vars=True).items() if id(v) in ours}


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load an optimiser's state but keep the kind it was built as: `load_state_dict` takes
    `fused` from the saved groups, so a state saved by an unfused optimiser (an older run, or
    one on the CPU) would silently turn a GPU run's fused AdamW off. Fused AdamW keeps each
    parameter's step count on the parameter's device, the others on the CPU."""
    built = [group["fused"] for group in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, fused in zip(optimizer.param_groups, built, strict=True):
        group["fused"] = fused
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if "step" in state:
                device = param.device if fused else torch.device("cpu")
                state["step"] = state["step"].to(device, torch.float32)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class Trainer:
    """One training run of `cfg` (new, or resumed from `cfg.out` with `cfg.resume`)."""

    def __init__(self, cfg: TrainConfig) -> None:
        cfg.check()
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.target = Target(cfg.model, self.device, dtype, cfg.load_format)
        self.data = TokenFile.load(cfg.data)
        if self.data.num_response_tokens() == 0:
            raise ValueError(
                f"{cfg.data} holds no responses (a prompt file? `python3 -m "
                "training generate` answers it)"
            )
        self.train_idx, self.eval_idx = split_indices(self.data)
        if len(self.train_idx) == 0:
            raise ValueError(f"{cfg.data} has no training sequences (all are dev)")
        self.recipe = build_recipe(
            cfg.algorithm,
            self.target,
            self.data,
            cfg.depth,
            cfg.seed,
            cfg.init_from or None,
            cfg.draft_vocab,
        )
        self.batches = length_batches(self.data, self.train_idx, cfg.tokens_per_batch, cfg.max_len)
        self.total_steps = cfg.total_steps or max(1, int(cfg.epochs * len(self.batches)))
        self.optimizer = torch.optim.AdamW(  # fused: one kernel per step on a GPU
            self.recipe.parameters(),
            lr=cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
            fused=self.device.type == "cuda",
        )
        self.step = 0
        self._order: tuple[int, list[np.ndarray]] = (-1, [])  # (epoch, its batches in order)
        self._open_run()
        n_params = sum(p.numel() for p in self.recipe.parameters())
        print(
            f"{cfg.algorithm}: {n_params / 1e6:.2f}M trainable parameters, "
            f"{len(self.train_idx)} training sequences "
            f"({self.data.num_response_tokens() / 1e6:.2f}M response tokens in the file), "
            f"{len(self.batches)} batches per epoch, {self.total_steps} steps, "
            f"starting at step {self.step}",
            flush=True,
        )

    # ------------------------------------------------------------------ state

    def _open_run(self) -> None:
        """Resume the run in `out`, or start one there (refused over another run's state)."""
        os.makedirs(self.cfg.out, exist_ok=True)
        self.state_path = os.path.join(self.cfg.out, "state.pt")
        self.log_path = os.path.join(self.cfg.out, "train_log.jsonl")
        if os.path.isfile(self.state_path):
            if not self.cfg.resume:
                raise ValueError(
                    f"{self.cfg.out} holds a training run: pass --resume to continue "
                    "it, or another --out to start a new one"
                )
            self._load_state()
            return
        if self.cfg.resume:
            print(f"no run to resume in {self.cfg.out}: starting a new one", flush=True)
        if os.path.exists(self.log_path):
            os.remove(self.log_path)

    def _load_state(self) -> None:
        """Continue a run from its state: weights, optimiser, step, schedule length and random
        state (so a resumed run computes what an uninterrupted one would)."""
        # map to the CPU: the random states must stay there; the rest moves on loading
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        saved = state["config"]
        changed = [k for k in TrainConfig.RESUMED if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            raise ValueError(
                f"{self.state_path} was written by a run with other {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): pass the same "
                "options, or another --out to start a new run"
            )
        if state["data"] != self._data_fingerprint():
            raise ValueError(f"{self.state_path} was trained on other data than {self.cfg.data}")
        for module, weights in zip(self.recipe.modules, state["modules"], strict=True):
            missing, unexpected = module.load_state_dict(weights, strict=False)
            if unexpected or set(missing) - shared_tensors(module, self.target):
                raise ValueError(
                    f"{self.state_path} does not match the draft: missing "
                    f"{missing}, unexpected {unexpected}"
                )
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda" and state["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def _data_fingerprint(self) -> list[int]:
        return [len(self.data), int(self.data.offsets[-1]), int(self.data.tokens.sum())]

    def _save_state(self) -> None:
        modules = []
        for m in self.recipe.modules:
            shared = shared_tensors(m, self.target)
            modules.append({k: v.detach() for k, v in m.state_dict().items() if k not in shared})
        rng = {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        state = {
            "config": asdict(self.cfg),
            "step": self.step,
            "total_steps": self.total_steps,
            "data": self._data_fingerprint(),
            "optimizer": self.optimizer.state_dict(),
            "modules": modules,
            "rng": rng,
        }
        torch.save(state, self.state_path + ".tmp")
        os.replace(self.state_path + ".tmp", self.state_path)

    def checkpoint(self) -> None:
        self._save_state()
        self.recipe.export(os.path.join(self.cfg.out, "draft"))

    def _log(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ the loop

    def evaluate(self) -> dict:
        if len(self.eval_idx) == 0:
            return {}
        cfg = self.cfg
        result = estimate_accept_length(
            self.recipe,
            self.target,
            self.data,
            self.eval_idx,
            DEFAULT_ESTIMATE_DEPTH,
            cfg.tokens_per_batch,
            cfg.max_len,
        )
        print(f"  step {self.step}: {describe_estimate(result)}", flush=True)
        self._log({"step": self.step, "eval": result})
        return result

    def run(self) -> dict:
        """Train to the end of the schedule or a limit -> the last estimate, with the step
        reached and whether the schedule finished."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else math.inf
        window: list[dict] = []
        window_start, first_step = time.perf_counter(), self.step
        while self.step < self.total_steps:
            epoch, index = divmod(self.step, len(self.batches))
            rows = make_rows(self.data, self._batches(epoch)[index], cfg.max_len)
            metrics = self.train_step(rows)
            self.step += 1
            if metrics is not None:
                window.append(metrics)
            out_of_time = time.monotonic() > deadline
            out_of_steps = cfg.max_steps and self.step - first_step >= cfg.max_steps
            stopping = self.step == self.total_steps or out_of_time or out_of_steps
            if window and (self.step % cfg.log_every == 0 or stopping):
                self._report(window, time.perf_counter() - window_start)
                window, window_start = [], time.perf_counter()
            if stopping:
                break
            if self.step % cfg.eval_every == 0:
                self.evaluate()
                self.checkpoint()
        finished = self.step == self.total_steps
        if not finished:
            print(
                f"limit reached: stopping at step {self.step} of {self.total_steps}; "
                "continue with --resume",
                flush=True,
            )
        result = self.evaluate()
        self.checkpoint()
        return {"step": self.step, "total_steps": self.total_steps, "finished": finished, **result}

    def _batches(self, epoch: int) -> list[np.ndarray]:
        """The batches of `epoch`, in that epoch's fixed shuffled order."""
        if self._order[0] != epoch:
            self._order = (epoch, list(epoch_order(self.batches, epoch, self.cfg.seed)))
        return self._order[1]

    # An unrolled chain's later steps run only where they can learn (`unroll_chain`); off only
    # to measure what that saves (bench_train_step.py --windows). Not a TrainConfig option: it
    # changes no result, so a run does not record it.
    window = True

    def train_step(self, rows: Rows) -> dict | None:
        """One optimiser step on a batch -> its metrics (None: nothing in it learns)."""
        rows = rows.to(self.device)
        lr = lr_at(self.cfg, self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        teacher = self.target.run(rows.ids, self.recipe.aux_layers, rows.teaches())
        synchronize(self.device)
        target_s = time.perf_counter() - start
        with autocast(self.device):
            loss, metrics = self.recipe.losses(rows, teacher, window=self.window)
        if loss is None:
            return None
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.recipe.parameters(), self.cfg.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        learned = int(rows.learns(1).sum())  # synchronises
        return {
            **metrics,
            "total": float(loss.detach()),
            "grad_norm": float(grad_norm),
            "lr": lr,
            "tokens": learned,
            "target_s": target_s,
            "step_s": time.perf_counter() - start,
        }

    def _report(self, window: list[dict], seconds: float) -> None:
        def mean(key: str) -> float:
            return float(np.mean([m[key] for m in window]))

        def per_step(key: str) -> list[float]:
            return np.mean([m[key] for m in window], axis=0).tolist()

        tokens_per_s = sum(m["tokens"] for m in window) / max(seconds, 1e-9)
        record = {
            "step": self.step,
            "loss": mean("total"),
            "loss_per_step": per_step("loss"),
            "acc": per_step("acc"),
            "lr": window[-1]["lr"],
            "grad_norm": mean("grad_norm"),
            "tokens_per_s": tokens_per_s,
            "step_ms": 1e3 * mean("step_s"),
            "target_ms": 1e3 * mean("target_s"),
        }
        memory = ""
        if self.device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            memory = f"  {record['max_memory_gib']:.1f} GiB"
        self._log(record)
        accs = " ".join(f"{a:.2f}" for a in record["acc"])
        print(
            f"step {self.step}/{self.total_steps}  loss {record['loss']:.4f}  acc/step {accs}  "
            f"lr {record['lr']:.2e}  {tokens_per_s / 1e3:.1f}k tok/s  "
            f"step {record['step_ms']:.0f} ms (target {record['target_ms']:.0f}){memory}",
            flush=True,
        )
