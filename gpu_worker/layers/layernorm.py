"""RMSNorm as in Llama/Qwen, optionally fused with the residual add before it.

`norm(x)` -> normalised x; `norm(x, residual)` -> (normalised x + residual, x + residual): one
kernel for the add and the norm that every decoder layer runs twice. `use_triton` (set by the
runner for the triton attention backend) picks the Triton kernel; the torch reference
otherwise. Both follow transformers' rounding (see `gpu_worker.kernels.norm`).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu_worker.kernels import norm


class RMSNorm(nn.Module):
    use_triton = False

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [..., hidden] -> same shape and dtype; with residual, (normed sum, sum)."""
        if residual is None:
            if self.use_triton:
                return norm.rms_norm(x, self.weight, self.eps)
            return norm.rms_norm_reference(x, self.weight, self.eps)
        if self.use_triton:
            return norm.add_rms_norm(x, residual, self.weight, self.eps)
        return norm.add_rms_norm_reference(x, residual, self.weight, self.eps)


def set_use_triton(model: nn.Module, use_triton: bool) -> None:
    """Choose Triton kernels or torch references for every layer of model that offers both."""
    for module in model.modules():
        if hasattr(type(module), "use_triton"):
            module.use_triton = use_triton
