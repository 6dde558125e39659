"""Training rows: a padded batch of sequences, and which positions a draft step learns from.

At draft step s (1-based; MTP layer k is step k + 1) row position t reads ids[t + s] and
learns the target's distribution at u = t + s (it predicts ids[u + 1]); a position counts when
prompt_len <= u + 1 <= length - 1. Helpers take the positions `at` [B, W] asked about.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from training.tokens import TokenFile

# Rows are padded to a multiple of this (fewer distinct shapes, kinder to the kernels).
PAD_MULTIPLE = 64
WINDOW_MULTIPLE = 16  # `Rows.window` widths (attention masks with aligned key counts)


@dataclass
class Rows:
    ids: torch.Tensor  # [B, T] int64, padded with 0
    lengths: torch.Tensor  # [B] int64
    prompt_lens: torch.Tensor  # [B] int64

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.ids.shape)  # type: ignore[return-value]

    def positions(self) -> torch.Tensor:
        """[B, T] every row position t."""
        b, t = self.shape
        return torch.arange(t, device=self.ids.device).expand(b, t)

    def shifted_ids(self, shift: int, at: torch.Tensor | None = None) -> torch.Tensor:
        """ids[t + shift] at the row positions `at` [B, W] (default: every position; 0 past
        the end of the padded row)."""
        at = self.positions() if at is None else at
        t = self.ids.shape[1]
        index = at + shift
        return torch.where(index < t, self.ids.gather(1, index.clamp(max=t - 1)), 0)

    def learns(self, shift: int, at: torch.Tensor | None = None) -> torch.Tensor:
        """bool at the row positions `at` [B, W] (default: every position): whether t learns
        at draft step `shift` (see the module docstring)."""
        predicted = (self.positions() if at is None else at) + shift + 1  # u + 1
        return (predicted >= self.prompt_lens[:, None]) & (predicted <= self.lengths[:, None] - 1)

    def window(self, depth: int) -> torch.Tensor:
        """[B, W] the row positions where steps 2..depth of a chain can learn: from
        prompt_len - depth - 1 (the first anchor whose last step predicts a response token) on,
        W the most any row needs (a multiple of WINDOW_MULTIPLE). Positions past a row's end
        learn nothing; those past the padded row repeat its last position (so rotary positions
        stay within the row's)."""
        start = (self.prompt_lens - depth - 1).clamp(min=0)
        width = int((self.lengths - start).max())
        width = -(-width // WINDOW_MULTIPLE) * WINDOW_MULTIPLE
        at = start[:, None] + torch.arange(width, device=self.ids.device)
        return at.clamp(max=self.ids.shape[1] - 1)

    def teaches(self) -> torch.Tensor:
        """[B, T] bool: the target's distribution at position u is what some draft step learns
        (u = t + s at a learning position t of step s), i.e. u predicts a response token:
        `learns` at shift 0."""
        return self.learns(0)

    def to(self, device: torch.device) -> Rows:
        return Rows(self.ids.to(device), self.lengths.to(device), self.prompt_lens.to(device))


def make_rows(data: TokenFile, indices: np.ndarray, max_len: int) -> Rows:
    """The sequences at `indices`, cut to max_len and right-padded to a PAD_MULTIPLE."""
    seqs = [data.sequence(int(i))[:max_len] for i in indices]
    width = -(-max(len(s) for s in seqs) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = np.zeros((len(seqs), width), dtype=np.int64)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    lengths = torch.tensor([len(s) for s in seqs])
    prompt = torch.minimum(torch.from_numpy(data.prompt_lens[indices].astype(np.int64)), lengths)
    return Rows(torch.from_numpy(ids), lengths, prompt)


def length_batches(
    data: TokenFile, indices: np.ndarray, tokens_per_batch: int, max_len: int
) -> list[np.ndarray]:
    """Split `indices` into batches of similar length whose padded size (rows x longest row)
    stays within tokens_per_batch (one long row may exceed it alone)."""
    lengths = np.minimum(data.lengths[indices], max_len)
    order = indices[np.argsort(lengths, kind="stable")]
    batches, current, longest = [], [], 0
    for i in order:
        n = min(int(data.lengths[i]), max_len)
        if current and max(longest, n) * (len(current) + 1) > tokens_per_batch:
            batches.append(np.array(current))
            current, longest = [], 0
        current.append(int(i))
        longest = max(longest, n)
    if current:
        batches.append(np.array(current))
    return batches


def epoch_order(batches: list[np.ndarray], epoch: int, seed: int) -> Iterator[np.ndarray]:
    """The batches in a shuffled order fixed by (seed, epoch), so a resumed run sees the same."""
    rng = np.random.default_rng([seed, epoch])
    for k in rng.permutation(len(batches)):
        yield batches[k]
