"""Where tests can run what: Triton kernels run on CUDA, and on CPU only in Triton's
interpreter (which tests/conftest.py switches on when there is no GPU); compiling them for a
GPU needs a process outside the interpreter (`compile_outside_the_interpreter`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

CPU_TRITON = os.environ.get("TRITON_INTERPRET") == "1"


def triton_devices() -> list[str]:
    """Devices on which Triton kernels can run in this test process."""
    return (["cpu"] if CPU_TRITON else []) + (["cuda"] if torch.cuda.is_available() else [])


def skip_unless_triton_runs_on(device: str) -> None:
    if device == "cpu" and not CPU_TRITON:
        pytest.skip("Triton runs on CPU only under TRITON_INTERPRET=1 (a GPU is present)")


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compile_outside_the_interpreter(script: str) -> None:
    """Run `script` (Python that compiles kernels with `triton.compile` for a GPU target and
    prints "compiled") in a subprocess without TRITON_INTERPRET: the interpreter does not
    type-check kernels, the CUDA compiler does, with no GPU needed. Skips where Triton has no
    CUDA toolchain; fails on a compilation error."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if "compiled" not in result.stdout and "CompilationError" not in result.stderr:
        pytest.skip(f"no Triton CUDA toolchain here: {result.stderr.strip()[-300:]}")
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-2000:]
