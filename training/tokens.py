"""Token files: many token sequences in one `.npz`, the format every stage of the tool hands on.

    tokens       [total] uint32   every sequence back to back
    offsets      [n + 1] int64    sequence i is tokens[offsets[i]:offsets[i + 1]]
    prompt_lens  [n]     int32    prompt tokens (chat template included); the rest is trained on
Extra arrays (e.g. `dev`, a bool per sequence) travel along untouched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class TokenFile:
    tokens: np.ndarray  # [total] uint32
    offsets: np.ndarray  # [n + 1] int64
    prompt_lens: np.ndarray  # [n] int32
    extra: dict[str, np.ndarray] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def num_response_tokens(self) -> int:
        return int((self.lengths - self.prompt_lens).sum())

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        prompt_lens: Sequence[int],
        **extra: np.ndarray,
    ) -> TokenFile:
        lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
        offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tokens = np.zeros(int(offsets[-1]), dtype=np.uint32)
        for i, s in enumerate(sequences):
            tokens[offsets[i] : offsets[i + 1]] = s
        prompt = np.asarray(prompt_lens, dtype=np.int32)
        if prompt.shape != lengths.shape or (prompt > lengths).any():
            raise ValueError("prompt_lens must give one length per sequence, each <= its length")
        return cls(tokens, offsets, prompt, dict(extra))

    def select(self, indices: np.ndarray) -> TokenFile:
        """The sequences at `indices`, in that order (extra arrays selected alike)."""
        seqs = [self.sequence(int(i)) for i in indices]
        extra = {k: v[indices] for k, v in self.extra.items()}
        return TokenFile.from_sequences(seqs, self.prompt_lens[indices], **extra)

    def save(self, path: str) -> None:
        """Write compressed, tokens as uint16 when every id fits (about a quarter of the raw
        size: prompt files travel to a GPU machine), atomically (a half-written file never
        carries the final name)."""
        tokens = self.tokens
        if tokens.size == 0 or int(tokens.max()) < 2**16:
            tokens = tokens.astype(np.uint16)
        tmp = f"{path}.tmp.npz"
        np.savez_compressed(
            tmp, tokens=tokens, offsets=self.offsets, prompt_lens=self.prompt_lens, **self.extra
        )
        os.replace(tmp, path)

    @classmethod
    def concat(cls, files: Sequence[TokenFile]) -> TokenFile:
        """The sequences of every file, in order (extra arrays the files share are kept)."""
        shared = set.intersection(*(set(f.extra) for f in files)) if files else set()
        seqs = [f.sequence(i) for f in files for i in range(len(f))]
        prompt = np.concatenate([f.prompt_lens for f in files])
        extra = {k: np.concatenate([f.extra[k] for f in files]) for k in sorted(shared)}
        return cls.from_sequences(seqs, prompt, **extra)

    def split(self, parts: int) -> list[TokenFile]:
        """The sequences in `parts` contiguous, nearly equal pieces (undone by `concat`)."""
        bounds = np.linspace(0, len(self), parts + 1).astype(np.int64)
        return [self.select(np.arange(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]

    @classmethod
    def load(cls, path: str) -> TokenFile:
        """One file, or several joined by commas (concatenated in order)."""
        if "," in path:
            return cls.concat([cls.load(p) for p in path.split(",") if p])
        with np.load(path) as data:
            arrays = {k: data[k] for k in data.files}
        missing = {"tokens", "offsets", "prompt_lens"} - set(arrays)
        if missing:
            raise ValueError(f"{path} is not a token file: it lacks {sorted(missing)}")
        tokens = arrays.pop("tokens").astype(np.uint32)
        return cls(tokens, arrays.pop("offsets"), arrays.pop("prompt_lens"), arrays)
