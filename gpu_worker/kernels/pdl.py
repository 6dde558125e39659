"""Programmatic dependent launch (PDL): a kernel launches while the one before it still runs.

A kernel that takes USE_PDL and calls `wait_for_previous(USE_PDL)` must, before that wait,
read only memory no kernel of a step writes (weights) and write nothing, and every path through
it must wait before any other read or write. Never `launch_pdl` a kernel that does not wait;
`launch_args` gives both switches together. Only launches of up to MAX_ROWS rows use it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENV = "AERIE_PDL"  # "0" turns PDL off, e.g. to rule it out when a driver misbehaves
FORCE_OFF = False  # bench_decode's "nopdl" variants
# Launches of more rows have library GEMMs, after which an early launch waits longer than it
# saves (bench_speculative.py --fused-rows measures other limits).
MAX_ROWS = 4
_capable: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    # (the interpreter has no grid dependency control; PDL needs compute capability 9.0)
    if FORCE_OFF or device.type != "cuda" or os.environ.get(ENV, "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _capable:
        _capable[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _capable[index]


def launch_args(device: torch.device, rows: int) -> dict[str, bool]:
    """The kernel's USE_PDL constexpr and Triton's launch option, on or off together, for a
    launch over `rows` rows (tokens)."""
    on = rows <= MAX_ROWS and enabled(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Where a kernel launched with PDL may start reading what earlier kernels wrote: waits
    until the kernel before it has completed, then lets the next one launch. Nothing
    without USE_PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
