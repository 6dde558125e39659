"""SiLU-and-multiply, the SwiGLU gate: gate_up [n, 2I] (gate then up, as the merged
gate_up_proj writes them) -> silu(gate) * up [n, I], computed in float32, rounded once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gpu_worker.kernels import pdl

BLOCK = 1024


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, in_stride, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    pdl.wait_for_previous(USE_PDL)  # everything it reads may come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(gate_up_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * in_stride + inter + cols, mask=mask, other=0.0)
    out = gate * tl.sigmoid(gate) * up.to(tl.float32)
    tl.store(out_ptr + row * inter + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [n, 2I] -> [n, I], a new tensor."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, triton.cdiv(inter, BLOCK))
        _silu_and_mul_kernel[grid](
            gate_up,
            out,
            gate_up.stride(0),
            inter,
            BLOCK=BLOCK,
            **pdl.launch_args(gate_up.device, rows),
        )
    return out
