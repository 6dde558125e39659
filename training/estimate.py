"""The offline accept estimate: how long a greedy chain of the draft would be accepted, walked
like the verifier along the target's own greedy continuations (an iteration at t accepts 1 +
the leading agreeing steps). On the same sequence and weights it equals the served batch-1
greedy accept lengths (a test checks it). Usage and options: `docs/drafts.md`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from training.build import build_recipe, split_indices
from training.recipes import Recipe
from training.repetition import REPEAT_NGRAM, repeated_share
from training.rows import Rows, length_batches, make_rows
from training.target import Target, resolve_device
from training.tokens import TokenFile

DEFAULT_ESTIMATE_DEPTH = 5  # the chain walked unless told otherwise (at most the draft's depth)
ANSWERS = ("all", "ended", "cut")  # --answers: every answer, those ended by a stop token, or cut


@dataclass
class EstimateConfig:
    algorithm: str  # eagle3 | eagle | mtp
    model: str
    draft: str  # an exported draft (what `--speculative-draft-model-path` takes)
    data: str  # the target's greedy continuations (`generate`); its dev split when it has one
    depth: int = 0  # the chain S; 0: 5 (MTP: the draft's layers)
    tokens_per_batch: int = 16384
    max_len: int = 2048
    device: str = "auto"
    answers: str = "all"  # all | ended (by a stop token) | cut (at the token limit): `finished`
    # Walk only each answer's first N tokens (0: all), as a server cutting answers at
    # max_new_tokens = N would serve them; the repeated share covers the same tokens.
    response_tokens: int = 0


def walk(run: np.ndarray, first: int, last: int) -> list[int]:
    """Accept lengths of the iterations a verifier walks through one sequence: an iteration
    after a prefix ending at t accepts 1 + run[t] tokens (run[t]: the leading chain steps that
    agree there) and the next one starts after them; the first follows the prompt (first =
    prompt length - 1), and iterations past `last` (whose chain would run off the sequence)
    are not walked."""
    accepts, t = [], first
    while t <= last:
        a = 1 + int(run[t])
        accepts.append(a)
        t += a
    return accepts


def chain_runs(agree: torch.Tensor, depth: int) -> torch.Tensor:
    """agree [steps, n] bool -> [n] the number of leading steps (at most depth) that agree."""
    return agree[:depth].int().cumprod(0).sum(0)


@torch.no_grad()
def estimate_accept_length(
    recipe: Recipe,
    target: Target,
    data: TokenFile,
    indices: np.ndarray,
    depth: int,
    tokens_per_batch: int,
    max_len: int,
    response_tokens: int = 0,
) -> dict:
    """The walked greedy chain accept length of `depth` draft steps (at most the recipe's)
    over the sequences at `indices`, and P(accept length >= k + 1) for k = 1..depth."""
    depth = min(depth, recipe.depth)
    accepts: list[int] = []
    recipe.training = False
    try:
        for batch in length_batches(data, indices, tokens_per_batch, max_len):
            rows = make_rows(data, batch, max_len).to(target.device)
            teacher = target.run(rows.ids, recipe.aux_layers, rows.teaches())
            with torch.autocast(target.device.type, torch.bfloat16, target.device.type == "cuda"):
                agree = recipe.chain_agreement(rows, teacher, depth)
            run = chain_runs(agree, depth).reshape(rows.shape).cpu().numpy()
            accepts += walk_rows(rows, run, depth, response_tokens)
    finally:
        recipe.training = True
    counts = np.bincount(np.asarray(accepts, dtype=np.int64), minlength=depth + 2)
    total = max(len(accepts), 1)
    at_least = [float(counts[k + 1 :].sum() / total) for k in range(1, depth + 1)]
    return {
        "accept_length": float(np.mean(accepts)) if accepts else 0.0,
        "per_step": at_least,
        "iterations": len(accepts),
        "depth": depth,
    }


def walk_rows(rows: Rows, run: np.ndarray, depth: int, response_tokens: int = 0) -> list[int]:
    """The walked accept lengths of every row (run [B, T] from `chain_runs`): a chain after t
    compares its last step with the token at t + depth + 1, which must exist. With
    response_tokens N > 0 only the iterations that start inside the first N response tokens
    are walked (the last may run past them, as a served iteration runs past max_new_tokens)."""
    out: list[int] = []
    for r in range(rows.shape[0]):
        length, prompt = int(rows.lengths[r]), int(rows.prompt_lens[r])
        last = length - depth - 2
        if response_tokens > 0:
            last = min(last, prompt + response_tokens - 2)
        out += walk(run[r], prompt - 1, last)
    return out


def answers_repeated_share(
    data: TokenFile, indices: np.ndarray, n: int = REPEAT_NGRAM, response_tokens: int = 0
) -> float:
    """`repeated_share` of the response tokens of the sequences at `indices` (the first
    response_tokens of each when > 0)."""
    end = response_tokens or None
    responses = (data.sequence(int(i))[int(data.prompt_lens[i]) :][:end].tolist() for i in indices)
    return repeated_share(responses, n)


def describe_estimate(result: dict) -> str:
    at_least = " ".join(f"{p:.2f}" for p in result["per_step"])
    text = (
        f"estimated chain accept length {result['accept_length']:.3f} (S={result['depth']}, "
        f"P(accept >= k+1) for k=1..S: {at_least}; {result['iterations']} iterations)"
    )
    if "repeated_share" in result:
        cut = result.get("response_tokens")
        text += (
            f"; {result['sequences']} answers ({result['answers']}"
            + (f", first {cut} tokens" if cut else "")
            + f"), {100 * result['repeated_share']:.1f}% of their tokens repeat an earlier "
            f"{REPEAT_NGRAM}-gram of the same answer"
        )
    return text


def select_answers(data: TokenFile, indices: np.ndarray, answers: str) -> np.ndarray:
    """The indices whose answers `answers` names (ANSWERS), by the data's `finished` flag."""
    if answers not in ANSWERS:
        raise ValueError(f"--answers must be one of {', '.join(ANSWERS)}, not {answers!r}")
    if answers == "all":
        return indices
    if "finished" not in data.extra:
        raise ValueError(
            f"--answers {answers} needs a data file written by `generate` (it "
            "marks each answer ended by a stop token or cut at the token limit)"
        )
    ended = data.extra["finished"].astype(bool)[indices]
    chosen = indices[ended if answers == "ended" else ~ended]
    if len(chosen) == 0:
        raise ValueError(
            f"--answers {answers}: none of the {len(indices)} answers to walk was "
            + ("ended by a stop token" if answers == "ended" else "cut")
        )
    return chosen


def estimate(cfg: EstimateConfig) -> dict:
    """The estimate of an exported draft over the greedy sequences of a data file (only its
    dev split when it marks one: the rest trained the draft)."""
    if cfg.response_tokens < 0:
        raise ValueError(f"--response-tokens must be >= 0, not {cfg.response_tokens}")
    data = TokenFile.load(cfg.data)
    _, indices = split_indices(data)
    if "dev" not in data.extra:
        indices = np.flatnonzero(data.extra.get("greedy", np.ones(len(data), dtype=bool)))
    indices = select_answers(data, indices, cfg.answers)
    device = resolve_device(cfg.device)
    target = Target(cfg.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    depth = cfg.depth
    if depth == 0 and cfg.algorithm == "mtp":
        with open(os.path.join(cfg.draft, "config.json")) as f:
            depth = int(json.load(f).get("num_nextn_predict_layers") or 0)
    depth = depth or DEFAULT_ESTIMATE_DEPTH
    recipe = build_recipe(cfg.algorithm, target, data, depth, init_from=cfg.draft)
    result = estimate_accept_length(
        recipe, target, data, indices, depth, cfg.tokens_per_batch, cfg.max_len, cfg.response_tokens
    )
    return {
        **result,
        "answers": cfg.answers,
        "response_tokens": cfg.response_tokens,
        "sequences": len(indices),
        "repeated_share": answers_repeated_share(
            data, indices, response_tokens=cfg.response_tokens
        ),
    }
