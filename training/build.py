"""Which recipe a command asks for: the algorithm, its depth, a new draft or an exported one,
and which sequences of a data file train it and which estimate it."""

from __future__ import annotations

import numpy as np

from training.eagle import EagleRecipe
from training.eagle3 import Eagle3Recipe
from training.mtp import MTPRecipe
from training.recipes import Recipe, draft_vocabulary
from training.target import Target
from training.tokens import TokenFile

# Draft depth by algorithm: EAGLE-3's training-time test unrolls 7 steps, EAGLE-1 trains one,
# an MTP stack has 3 layers.
DEFAULT_DEPTH = {"eagle3": 7, "eagle": 1, "mtp": 3}
ALGORITHMS = tuple(DEFAULT_DEPTH)


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
    depth: int = 0,
    seed: int = 0,
    init_from: str | None = None,
    draft_vocab: int = 8192,
) -> Recipe:
    """The recipe of `algorithm` (depth 0: its default), new or from an exported draft; a new
    EAGLE-3 draft's vocabulary is the draft_vocab most frequent response tokens of data."""
    if algorithm not in DEFAULT_DEPTH:
        raise ValueError(f"unknown algorithm {algorithm!r}: use one of {', '.join(ALGORITHMS)}")
    depth = depth or DEFAULT_DEPTH[algorithm]
    if algorithm == "eagle":
        return EagleRecipe(target, depth, seed, init_from)
    if algorithm == "mtp":
        return MTPRecipe(target, depth, seed, init_from)
    if init_from is not None:
        return Eagle3Recipe(target, depth, seed, init_from=init_from)
    if data is None:
        raise ValueError("a new EAGLE-3 draft takes its vocabulary from the data")
    counts = response_token_counts(data, target.config.vocab_size)
    hot = draft_vocabulary(counts, min(draft_vocab, target.config.vocab_size))
    covered = counts[hot].sum() / max(counts.sum(), 1)
    print(f"draft vocabulary: {len(hot)} tokens cover {covered:.1%} of response tokens")
    return Eagle3Recipe(target, depth, seed, hot)


def split_indices(data: TokenFile) -> tuple[np.ndarray, np.ndarray]:
    """(train, estimate) sequence indices: the dev split is held out; the estimate walks its
    greedy sequences (the target's own greedy continuations)."""
    n = len(data)
    dev = data.extra.get("dev", np.zeros(n, dtype=bool)).astype(bool)
    greedy = data.extra.get("greedy", np.ones(n, dtype=bool)).astype(bool)
    return np.flatnonzero(~dev), np.flatnonzero(dev & greedy)
