"""Constant tensors made once per shape and device (`arange`, `full`, and `cached` for others).

The speculative stages index with the same small ranges every step; building each with a kernel
costs a launch every step, in a graph or out of one. Callers never write into these tensors.
One made while a CUDA graph is being captured is not kept: its values would only exist once
the graph replays (the stage graphs run every batch size eagerly before capturing it, so the
constants are made there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")
_CACHE: dict[tuple, Any] = {}


def cached(key: tuple, device: torch.device | str, make: Callable[[], T]) -> T:
    """make() once per (key, device); tensors it returns are never written."""
    device = torch.device(device)
    tensor = _CACHE.get((*key, device))
    if tensor is None:
        tensor = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CACHE[(*key, device)] = tensor
    return tensor


def arange(n: int, device: torch.device | str) -> torch.Tensor:
    """torch.arange(n) as int64 on device."""
    return cached(("arange", n), device, lambda: torch.arange(n, device=device))


def full(n: int, value: int, device: torch.device | str) -> torch.Tensor:
    """[n] int64 filled with value on device."""
    return cached(
        ("full", n, value),
        device,
        lambda: torch.full((n,), value, dtype=torch.int64, device=device),
    )


def ones_float(n: int, device: torch.device | str) -> torch.Tensor:
    """[n] float32 ones on device."""
    return cached(
        ("ones_float", n), device, lambda: torch.ones(n, dtype=torch.float32, device=device)
    )
