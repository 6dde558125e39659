"""The training loop: batches of target-generated conversations, the target's teacher signals,
the recipe's loss, AdamW with warm-up and cosine decay, progress, an offline accept estimate,
checkpoints that resume, and the exported draft.

Everything lands in the output directory:
    draft/        the exported draft (what `--speculative-draft-model-path` takes)
    state.pt      the full training state (`--resume` continues from it)
    train_log.jsonl   one record per logged step and per evaluation
A run stops at the end of its epochs or when `max_minutes` is up, whichever comes first, and
always leaves a state and a draft behind, so a time-limited machine can train across calls.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from training.estimate import describe_estimate, estimate_accept_length
from training.recipes import Recipe, draft_vocabulary
from training.rows import Rows, epoch_order, length_batches, make_rows
from training.target import Target
from training.tokens import TokenFile


@dataclass
class TrainConfig:
    algorithm: str  # eagle3 | eagle | mtp
    model: str
    data: str
    out: str
    steps: int = 0  # draft steps unrolled (MTP: layers); 0 = the recipe's default
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


DEFAULT_STEPS = {"eagle3": 7, "eagle": 1, "mtp": 3}
EVAL_CHAIN = 5  # the chain depth of the offline estimate (capped by the recipe's steps)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def response_token_counts(data: TokenFile, vocab_size: int) -> np.ndarray:
    """[vocab] how often each token occurs in the responses."""
    mask = np.ones(len(data.tokens), dtype=bool)
    for i, p in enumerate(data.prompt_lens):
        mask[data.offsets[i] : data.offsets[i] + p] = False
    return np.bincount(data.tokens[mask].astype(np.int64), minlength=vocab_size)


def build_recipe(
    algorithm: str,
    target: Target,
    data: TokenFile | None,
    steps: int = 0,
    seed: int = 0,
    init_from: str | None = None,
    draft_vocab: int = 8192,
) -> Recipe:
    """The recipe of `algorithm` (steps 0: its default depth), new or from an exported draft;
    a new EAGLE-3 draft's vocabulary is the draft_vocab most frequent response tokens of data."""
    from training.eagle import EagleRecipe
    from training.eagle3 import Eagle3Recipe
    from training.mtp import MTPRecipe

    if algorithm not in DEFAULT_STEPS:
        raise ValueError(f"unknown algorithm {algorithm!r} (eagle3, eagle, mtp)")
    steps = steps or DEFAULT_STEPS[algorithm]
    if algorithm == "eagle":
        return EagleRecipe(target, steps, seed, init_from)
    if algorithm == "mtp":
        return MTPRecipe(target, steps, seed, init_from)
    if init_from is not None:
        return Eagle3Recipe(target, steps, seed, init_from=init_from)
    if data is None:
        raise ValueError("a new EAGLE-3 draft takes its vocabulary from the data")
    counts = response_token_counts(data, target.config.vocab_size)
    hot = draft_vocabulary(counts, min(draft_vocab, target.config.vocab_size))
    covered = counts[hot].sum() / max(counts.sum(), 1)
    print(f"draft vocabulary: {len(hot)} tokens cover {covered:.1%} of response tokens")
    return Eagle3Recipe(target, steps, seed, hot)


def split_indices(data: TokenFile) -> tuple[np.ndarray, np.ndarray]:
    """(train, estimate) sequence indices: the dev split is held out; the estimate walks its
    greedy sequences (the target's own greedy continuations)."""
    n = len(data)
    dev = data.extra.get("dev", np.zeros(n, dtype=bool)).astype(bool)
    greedy = data.extra.get("greedy", np.ones(n, dtype=bool)).astype(bool)
    return np.flatnonzero(~dev), np.flatnonzero(dev & greedy)


def lr_at(cfg: TrainConfig, step: int, total: int) -> float:
    warmup = max(1, int(cfg.warmup * total))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def shared_tensors(module: torch.nn.Module, target: Target) -> list[tuple[str, torch.Tensor]]:
    """The entries of module's state dict that are the target's (frozen, never saved)."""
    ours = {id(p) for p in target.model.parameters()}
    return [(k, v) for k, v in module.state_dict(keep_vars=True).items() if id(v) in ours]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def autocast(device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        torch.manual_seed(cfg.seed)
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.target = Target(cfg.model, self.device, dtype, cfg.load_format)
        self.data = TokenFile.load(cfg.data)
        self.train_idx, self.eval_idx = split_indices(self.data)
        if len(self.train_idx) == 0:
            raise ValueError(f"{cfg.data} has no training sequences (all are dev)")
        self.recipe = build_recipe(cfg.algorithm, self.target, self.data, cfg.steps, cfg.seed,
                                   cfg.init_from or None, cfg.draft_vocab)  # fmt: skip
        self.batches = length_batches(self.data, self.train_idx, cfg.tokens_per_batch, cfg.max_len)
        self.total_steps = cfg.total_steps or max(1, int(cfg.epochs * len(self.batches)))
        self.optimizer = torch.optim.AdamW(
            self.recipe.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0
        )
        self.step = 0
        os.makedirs(cfg.out, exist_ok=True)
        self.state_path = os.path.join(cfg.out, "state.pt")
        self.log_path = os.path.join(cfg.out, "train_log.jsonl")
        if cfg.resume and os.path.isfile(self.state_path):
            self._load_state()
        elif os.path.exists(self.log_path):  # a new run: its log starts empty
            os.remove(self.log_path)
        n_params = sum(p.numel() for p in self.recipe.parameters())
        print(f"{cfg.algorithm}: {n_params / 1e6:.2f}M trainable parameters, "
              f"{len(self.train_idx)} training sequences "
              f"({self.data.num_response_tokens() / 1e6:.2f}M response tokens in the file), "
              f"{len(self.batches)} batches per epoch, {self.total_steps} steps, "
              f"starting at step {self.step}", flush=True)  # fmt: skip

    # Fields a resumed run must share with the run it continues (the data is checked too).
    RESUME_FIELDS = ("algorithm", "model", "steps", "draft_vocab", "tokens_per_batch", "max_len",
                     "seed", "init_from")  # fmt: skip

    def _load_state(self) -> None:
        """Continue a run from its state: weights, optimiser, step, schedule length and random
        state (so a resumed run computes what an uninterrupted one would)."""
        state = torch.load(self.state_path, map_location=self.device, weights_only=False)
        saved = state["config"]
        changed = [k for k in self.RESUME_FIELDS if saved.get(k) != getattr(self.cfg, k)]
        if changed:
            raise ValueError(
                f"{self.state_path} was written by a run with other {', '.join(changed)} "
                f"({', '.join(f'{k}={saved.get(k)!r}' for k in changed)}): pass the same "
                "options, or another --out to start a new run"
            )
        if state["data"] != self._data_fingerprint():
            raise ValueError(f"{self.state_path} was trained on other data than {self.cfg.data}")
        shared = {name for m in self.recipe.modules for name, _ in shared_tensors(m, self.target)}
        for module, weights in zip(self.recipe.modules, state["modules"], strict=True):
            missing, unexpected = module.load_state_dict(weights, strict=False)
            if unexpected or set(missing) - shared:
                raise ValueError(f"{self.state_path} does not match the draft: missing "
                                 f"{missing}, unexpected {unexpected}")  # fmt: skip
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        torch.set_rng_state(state["rng"]["cpu"])
        if self.device.type == "cuda" and state["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)

    def _data_fingerprint(self) -> list[int]:
        return [len(self.data), int(self.data.offsets[-1]), int(self.data.tokens.sum())]

    def _save_state(self) -> None:
        modules = []
        for m in self.recipe.modules:
            shared = {name for name, _ in shared_tensors(m, self.target)}
            modules.append({k: v.detach() for k, v in m.state_dict().items() if k not in shared})
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda"
               else None}  # fmt: skip
        state = {"config": asdict(self.cfg), "step": self.step, "total_steps": self.total_steps,
                 "data": self._data_fingerprint(), "optimizer": self.optimizer.state_dict(),
                 "modules": modules, "rng": rng}  # fmt: skip
        torch.save(state, self.state_path + ".tmp")
        os.replace(self.state_path + ".tmp", self.state_path)

    def _log(self, record: dict) -> None:
        with open(self.log_path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def evaluate(self) -> dict:
        if len(self.eval_idx) == 0:
            return {}
        cfg = self.cfg
        result = estimate_accept_length(self.recipe, self.target, self.data, self.eval_idx,
                                        EVAL_CHAIN, cfg.tokens_per_batch, cfg.max_len)  # fmt: skip
        print(f"  step {self.step}: {describe_estimate(result)}", flush=True)
        self._log({"step": self.step, "eval": result})
        return result

    def checkpoint(self) -> None:
        self._save_state()
        self.recipe.export(os.path.join(self.cfg.out, "draft"))

    def run(self) -> dict:
        cfg = self.cfg
        deadline = time.monotonic() + cfg.max_minutes * 60 if cfg.max_minutes > 0 else math.inf
        window_tokens, window_start, window = 0, time.perf_counter(), []
        stopped_early, first_step = False, self.step
        while self.step < self.total_steps:
            epoch, index = divmod(self.step, len(self.batches))
            batch = self._epoch_batches(epoch)[index]
            metrics = self.train_step(make_rows(self.data, batch, cfg.max_len))
            self.step += 1
            window.append(metrics)
            window_tokens += metrics["tokens"]
            if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                elapsed = time.perf_counter() - window_start
                self._report(window, window_tokens / max(elapsed, 1e-9))
                window_tokens, window_start, window = 0, time.perf_counter(), []
            if self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                self.evaluate()
                self.checkpoint()
            out_of_steps = cfg.max_steps and self.step - first_step >= cfg.max_steps
            if (time.monotonic() > deadline or out_of_steps) and self.step < self.total_steps:
                stopped_early = True
                print(f"limit reached: stopping at step {self.step} of {self.total_steps}; "
                      "continue with --resume", flush=True)  # fmt: skip
                break
        result = self.evaluate()
        self.checkpoint()
        return {"step": self.step, "total_steps": self.total_steps, "finished": not stopped_early,
                **result}  # fmt: skip

    def _epoch_batches(self, epoch: int) -> list[np.ndarray]:
        if getattr(self, "_epoch", None) != epoch:
            self._epoch, self._order = epoch, list(epoch_order(self.batches, epoch, self.cfg.seed))
        return self._order

    def train_step(self, rows: Rows) -> dict:
        rows = rows.to(self.device)
        lr = lr_at(self.cfg, self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        teacher = self.target.run(rows.ids, self.recipe.aux_layers)
        synchronize(self.device)
        target_s = time.perf_counter() - start
        with autocast(self.device):
            loss, metrics = self.recipe.losses(rows, teacher)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.recipe.parameters(), self.cfg.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        learned = int(rows.learns(1).sum())  # synchronises
        return {**metrics, "total": float(loss.detach()), "grad_norm": float(grad_norm),
                "lr": lr, "tokens": learned, "target_s": target_s,
                "step_s": time.perf_counter() - start}  # fmt: skip

    def _report(self, window: list[dict], tokens_per_s: float) -> None:
        mean = lambda key: float(np.mean([m[key] for m in window]))  # noqa: E731
        steps = len(window[0]["acc"])
        acc = [float(np.mean([m["acc"][s] for m in window])) for s in range(steps)]
        record = {"step": self.step, "loss": mean("total"), "acc": acc, "lr": window[-1]["lr"],
                  "grad_norm": mean("grad_norm"), "tokens_per_s": tokens_per_s,
                  "step_ms": 1e3 * mean("step_s"), "target_ms": 1e3 * mean("target_s")}  # fmt: skip
        memory = ""
        if self.device.type == "cuda":
            record["max_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            memory = f"  {record['max_memory_gib']:.1f} GiB"
        self._log(record)
        accs = " ".join(f"{a:.2f}" for a in acc)
        print(f"step {self.step}/{self.total_steps}  loss {record['loss']:.4f}  acc/step {accs}  "
              f"lr {record['lr']:.2e}  {tokens_per_s / 1e3:.1f}k tok/s  "
              f"step {record['step_ms']:.0f} ms (target {record['target_ms']:.0f}){memory}",
              flush=True)  # fmt: skip
