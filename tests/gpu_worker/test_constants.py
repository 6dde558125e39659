"""Constant index tensors: made once per shape and device, with the values asked for."""

from __future__ import annotations

import torch

from gpu_worker import constants


def test_constants_are_made_once_with_their_values():
    first = constants.arange(5, "cpu")
    assert first is constants.arange(5, "cpu")
    assert first.tolist() == [0, 1, 2, 3, 4] and first.dtype == torch.int64
    assert constants.arange(6, "cpu").tolist() == list(range(6))
    filled = constants.full(3, 7, "cpu")
    assert filled is constants.full(3, 7, "cpu") and filled.tolist() == [7, 7, 7]
    assert constants.full(3, 8, "cpu").tolist() == [8, 8, 8]
    calls = []
    made = constants.cached(("test", 1), "cpu", lambda: calls.append(1) or torch.zeros(2))
    assert constants.cached(("test", 1), "cpu", lambda: calls.append(1)) is made
    assert calls == [1]
