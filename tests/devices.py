"""Where tests can run what: Triton kernels run on CUDA, and on CPU only in Triton's
interpreter (which tests/conftest.py switches on when there is no GPU)."""

from __future__ import annotations

import os

import pytest
import torch

CPU_TRITON = os.environ.get("TRITON_INTERPRET") == "1"


def triton_devices() -> list[str]:
    """Devices on which Triton kernels can run in this test process."""
    return (["cpu"] if CPU_TRITON else []) + (["cuda"] if torch.cuda.is_available() else [])


def skip_unless_triton_runs_on(device: str) -> None:
    if device == "cpu" and not CPU_TRITON:
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET=1 (a GPU is present)")
