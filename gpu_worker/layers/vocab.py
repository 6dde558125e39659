"""Vocabulary-parallel embedding and LM head (`gpu_worker.parallel`).

Each rank holds the rows of one contiguous block of token ids (`TensorParallel.vocab_block`;
the last block is padded with zero rows past the vocabulary). The embedding looks up the ids
of its block, zeros the others and all-reduces; the LM head computes its block's logits and
all-gathers them, dropping the padding. Size 1 is a plain `nn.Embedding` / `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_worker.kernels import batch_invariant
from gpu_worker.layers.linear import Loader
from gpu_worker.parallel import TensorParallel


def _load_block(weight: torch.Tensor, tensor: torch.Tensor, start: int, vocab_size: int) -> None:
    """Copy rows [start, start + len(weight)) of a [vocab_size, H] checkpoint tensor (zeros
    past vocab_size)."""
    if tensor.shape[0] != vocab_size or tensor.shape[1:] != weight.shape[1:]:
        raise ValueError(
            f"weight has shape {tuple(tensor.shape)}, expected ({vocab_size}, {weight.shape[1]})"
        )
    rows = max(0, min(weight.shape[0], vocab_size - start))
    weight[:rows].copy_(tensor[start : start + rows])
    weight[rows:].zero_()


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, embedding_dim: int, tp: TensorParallel) -> None:
        self.vocab_start, local = tp.vocab_block(vocab_size)
        super().__init__(local, embedding_dim)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, H]."""
        if self.tp.size == 1:
            return super().forward(ids)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [n, H]
        return self.tp.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))

    @torch.no_grad()
    def load_weight(self, tensor: torch.Tensor) -> None:
        _load_block(self.weight, tensor, self.vocab_start, self.vocab_size)

    def checkpoint_loaders(self, path: str) -> dict[str, Loader]:
        return {f"{path}.weight": self.load_weight}


class ParallelLMHead(nn.Linear):
    def __init__(self, hidden_size: int, vocab_size: int, tp: TensorParallel) -> None:
        self.vocab_start, local = tp.vocab_block(vocab_size)
        super().__init__(hidden_size, local, bias=False)
        self.tp, self.vocab_size = tp, vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> logits [n, vocab_size] (every rank gets all of them)."""
        logits = batch_invariant.linear_any(hidden, self.weight)  # [n, vocab block]
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits)[:, : self.vocab_size]

    @torch.no_grad()
    def load_weight(self, tensor: torch.Tensor) -> None:
        _load_block(self.weight, tensor, self.vocab_start, self.vocab_size)

    def checkpoint_loaders(self, path: str) -> dict[str, Loader]:
        return {f"{path}.weight": self.load_weight}
