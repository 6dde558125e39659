"""The soft cross-entropy of draft logits z [m, V] against teacher rows p[at] [m, V], fused on a
GPU: loss[i] = lse(z[i]) P_i - sum_v p[at[i], v] z[i, v], gradient softmax(z[i]) P_i - p[at[i]]
(P_i = sum_v p[at[i], v]). The kernels read teacher rows in place, one pass each way;
`soft_cross_entropy_reference` is the torch form, used on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

BLOCK = 2048
FLOOR = tl.constexpr(-1e30)  # below any logit


def soft_cross_entropy_reference(
    logits: torch.Tensor, probs: torch.Tensor, at: torch.Tensor
) -> torch.Tensor:
    """logits [m, V], probs [N, V], at [m] -> [m] float32: the cross-entropy of each row's
    draft distribution against teacher row at[i]."""
    return -(probs[at] * F.log_softmax(logits.float(), -1)).sum(-1)


@triton.jit
def _forward_kernel(
    z_ptr,
    p_ptr,
    at_ptr,
    loss_ptr,
    lse_ptr,
    mass_ptr,
    z_stride,
    p_stride,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    teacher = tl.load(at_ptr + row).to(tl.int64)
    # per lane: an online logsumexp (max and the sum of exp below it), the dot product with the
    # teacher and its mass; FLOOR stands for -inf (no inf - inf anywhere)
    running_max = tl.full([BLOCK], FLOOR, tl.float32)
    running_sum = tl.zeros([BLOCK], tl.float32)
    dot = tl.zeros([BLOCK], tl.float32)
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        z = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=FLOOR).to(tl.float32)
        p = tl.load(p_ptr + teacher * p_stride + cols, mask=mask, other=0.0).to(tl.float32)
        new_max = tl.maximum(running_max, z)
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.where(
            mask, tl.exp(z - new_max), 0.0
        )
        running_max = new_max
        dot += p * z  # p is 0 where masked
        mass += p
    top = tl.max(running_max, 0)
    lse = top + tl.log(tl.sum(running_sum * tl.exp(running_max - top), 0))
    p_mass = tl.sum(mass, 0)
    tl.store(loss_ptr + row, lse * p_mass - tl.sum(dot, 0))
    tl.store(lse_ptr + row, lse)
    tl.store(mass_ptr + row, p_mass)


@triton.jit
def _backward_kernel(
    grad_ptr,
    z_ptr,
    p_ptr,
    at_ptr,
    lse_ptr,
    mass_ptr,
    dz_ptr,
    z_stride,
    p_stride,
    vocab,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < vocab
    teacher = tl.load(at_ptr + row).to(tl.int64)
    g = tl.load(grad_ptr + row)
    lse = tl.load(lse_ptr + row)
    p_mass = tl.load(mass_ptr + row)
    z = tl.load(z_ptr + row * z_stride + cols, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + teacher * p_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dz = g * (tl.exp(z - lse) * p_mass - p)
    tl.store(dz_ptr + row * vocab + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        logits, probs = logits.contiguous(), probs.contiguous()
        m, vocab = logits.shape
        loss = torch.empty(m, dtype=torch.float32, device=logits.device)
        lse, mass = torch.empty_like(loss), torch.empty_like(loss)
        if m:
            _forward_kernel[(m,)](
                logits,
                probs,
                at,
                loss,
                lse,
                mass,
                logits.stride(0),
                probs.stride(0),
                vocab,
                BLOCK=BLOCK,
            )
        ctx.save_for_backward(logits, probs, at, lse, mass)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        logits, probs, at, lse, mass = ctx.saved_tensors
        m, vocab = logits.shape
        dz = torch.empty_like(logits)
        if m:
            grid = (m, triton.cdiv(vocab, BLOCK))
            _backward_kernel[grid](
                grad.float().contiguous(),
                logits,
                probs,
                at,
                lse,
                mass,
                dz,
                logits.stride(0),
                probs.stride(0),
                vocab,
                BLOCK=BLOCK,
            )
        return dz, None, None


def soft_cross_entropy_fused(
    logits: torch.Tensor, probs: torch.Tensor, at: torch.Tensor
) -> torch.Tensor:
    """The Triton form of `soft_cross_entropy_reference` (no gradient to the teacher); every
    at[i] must be a row of probs (the kernels do not check)."""
    assert logits.shape[1] == probs.shape[1] and at.shape == logits.shape[:1]
    return _SoftCrossEntropy.apply(logits, probs.detach(), at.contiguous())


_fused_on_gpu = True


def set_fused_on_gpu(enabled: bool) -> None:
    """Whether `soft_cross_entropy` runs the kernels on a GPU (off: the reference everywhere,
    the baseline `benchmarks/bench_train_step.py --losses reference` measures)."""
    global _fused_on_gpu
    _fused_on_gpu = enabled


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """[m] soft cross-entropy of logits [m, V] against probs[at]: the fused kernels on a GPU,
    the reference elsewhere."""
    if logits.is_cuda and _fused_on_gpu:
        return soft_cross_entropy_fused(logits, probs, at)
    return soft_cross_entropy_reference(logits, probs, at)
