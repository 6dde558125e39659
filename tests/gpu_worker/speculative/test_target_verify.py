"""Acceptance with penalties: every tree node is penalised for the drafts on its own path."""

from __future__ import annotations

import numpy as np
import torch

from aerie.messages import SamplingParams
from gpu_worker.sampling import SamplingState
from gpu_worker.speculative.target_verify import accept_tree
from gpu_worker.speculative.tree import build_tree


def test_penalties_count_the_drafts_on_each_nodes_path():
    """Chain root 3 -> 5 -> 5; the target prefers 5 over 6 by 0.5 everywhere. With a frequency
    penalty of 1, plain decoding emits 5 then 6 (5 was just emitted); so must verification."""
    vocab, steps = 8, 2
    sampling = SamplingState(2, vocab, "cpu")
    sampling.start(1, SamplingParams(temperature=0.0, frequency_penalty=1.0), [0], 0, 0)
    tree = build_tree(torch.tensor([3]), torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]),
                      torch.tensor([[5, 5]]), torch.tensor([4]), 1, steps, steps + 1)
    logits = torch.zeros(steps + 1, vocab)
    logits[:, 5], logits[:, 6] = 1.0, 0.5
    result, _ = accept_tree(sampling, tree, logits, torch.tensor([1]), np.array([1]))
    path = result.accept_index[0][result.accept_index[0] >= 0]
    spec = result.predict[path].tolist()
    plain = []
    for _ in range(steps + 1):
        rows = torch.tensor([1])
        penalised = sampling.penalize(logits[:1].clone(), rows, sampling.gather(rows))
        plain.append(int(penalised.argmax()))
        sampling.observe(rows, torch.tensor([plain[-1]]))
    assert spec == plain[: len(spec)] == [5, 6]
