"""Process-wide test set-up: without a GPU, Triton kernels run in Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported (its decorator reads it), so it
is set here, at the root of the test tree; on a CUDA machine the kernels compile for the GPU.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ.setdefault("TRITON_INTERPRET", "1")
