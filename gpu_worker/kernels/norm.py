"""RMSNorm, alone and fused with the residual add before it in every decoder layer.

Numerics follow Llama/Qwen (and transformers): the sum rounded to the input dtype, the
normalisation in float32, rounded to the input dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2, pdl


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(dtype)


def add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_reference(summed, weight, eps), summed


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.wait_for_previous(USE_PDL)  # everything it reads may come from the kernel before
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)  # rounded like x + r
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, axis=0) / hidden
    normed = (xf * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, out=None):
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if out is None:
        out = torch.empty(rows.shape, dtype=torch.result_type(x, weight), device=x.device)
    assert out.shape == rows.shape and out.stride(-1) == 1
    residual_out = torch.empty_like(rows) if residual is not None else out
    res = residual.reshape(-1, hidden) if residual is not None else rows
    block = next_power_of_2(hidden)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            residual_out,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
            **pdl.launch_args(x.device, rows.shape[0]),
        )
    return out.view(x.shape) if out.is_contiguous() else out, residual_out.view(x.shape)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., hidden] (rows may be strided, the last dim contiguous) -> a new tensor, or
    `out` [rows, hidden] (rows may be strided: e.g. one half of a wider buffer) filled."""
    return _launch(x, None, weight, eps, out)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normalised x + residual, x + residual), both new tensors shaped like x."""
    return _launch(x, residual, weight, eps)
