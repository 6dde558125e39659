"""Programmatic dependent launch (PDL) for the small kernels of a decode step.

At batch 1 a decoder layer is five kernels of a few microseconds each, and most of each is
latency: the launch, the first loads, the drain before the next kernel may start. With PDL
(compute capability 9.0 and later) a kernel is launched while the one before it in the stream
still runs. Its programs start, read what no kernel of a step ever writes (the weights), and
then wait (`gdc_wait`) until the kernel before it has completed and its writes are visible;
once past that wait, each lets the next kernel launch (`gdc_launch_dependents`). So a
projection's weight is already in registers when its input becomes ready, and at most one
kernel waits ahead of the one running. CUDA graphs keep the overlap: stream capture records
such a launch as a programmatic edge.

The rules for a kernel that takes USE_PDL and calls `wait_for_previous(USE_PDL)`:
- before its `gdc_wait` it reads only memory that no kernel writes while a step runs (weights
  and other parameters) and writes nothing;
- every path through it calls `gdc_wait` before any other read or any write.
A kernel that never waits must not be launched with `launch_pdl`: it could read its inputs
before they are written. `launch_args(device, rows)` gives both switches together.

Only launches of at most MAX_ROWS rows (tokens) use it: a plain step of up to four requests, a
chain S = 3's verify, the draft extend of one request. The same limit is where a small weight's
projection runs our fused kernel (`small_m_linear.choose_config`), which lets the next launch
only once its own wait has returned. With many more rows the projections are library
GEMMs, and a kernel launched early after one of those waited on the device for longer than it
saved (batch 64 below). On the 8B shape, whose projections of 2-4 rows are library GEMMs, PDL
on the other kernels of those launches still gains (docs/performance.md, "The plain decode
step" and "The 8B shape": bench_decode.py's triton+graph against nopdl+graph).

Off on CPU (Triton's interpreter has no grid dependency control), before compute capability 9.0,
and where AERIE_PDL=0 (e.g. to rule it out when a driver misbehaves); `FORCE_OFF` is for
benchmarks that compare the two launches.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

ENV = "AERIE_PDL"
FORCE_OFF = False  # bench_decode's "nopdl" variants
MAX_ROWS = 4  # bench_speculative.py --fused-rows measures other limits
_capable: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
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
