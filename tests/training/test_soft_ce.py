"""The fused soft cross-entropy (training.soft_ce) against its torch reference: loss and the
gradient to the draft's logits, teacher rows read through `at` (repeated, out of order), on the
CPU under Triton's interpreter and on CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.devices import compile_outside_the_interpreter, triton_devices
from training.soft_ce import BLOCK, soft_cross_entropy_fused, soft_cross_entropy_reference


def cases():
    out = []
    for device in triton_devices():
        out += [(device, torch.float32, 37), (device, torch.float32, BLOCK + 301)]
        if device == "cuda":
            out += [(device, torch.bfloat16, 8192), (device, torch.bfloat16, 49152)]
    return out


@pytest.mark.parametrize("device, dtype, vocab", cases())
def test_fused_soft_cross_entropy_matches_the_reference(device, dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    m, n = 6, 4
    logits = (3 * torch.randn(m, vocab, generator=gen)).to(device, dtype)
    probs = torch.softmax(3 * torch.randn(n, vocab, generator=gen), -1)
    probs[1] = 0.0
    probs[1, 5] = 1.0  # a one-hot teacher row
    probs[3] *= 0.5  # a row of mass 0.5: the loss and gradient scale lse and softmax by it
    probs = probs.to(device)
    at = torch.tensor([2, 0, 2, 1, 3, 0], device=device)
    weights = torch.randn(m, generator=gen).to(device)  # a gradient that differs per row

    results = []
    for loss_fn in (soft_cross_entropy_fused, soft_cross_entropy_reference):
        z = logits.clone().requires_grad_(True)
        loss = loss_fn(z, probs, at)
        (loss * weights).sum().backward()
        results.append((loss.detach(), z.grad))
    (loss, grad), (ref_loss, ref_grad) = results
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-4)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-4}
    torch.testing.assert_close(grad, ref_grad, **tol)
    assert loss[1] != loss[5]  # rows that share a teacher row still differ by their logits


def test_rows_of_a_uniform_draft_cost_the_teachers_cross_entropy():
    """A flat draft over V tokens costs log V against any distribution: the fused forward's
    online logsumexp across blocks, checked against a closed form."""
    if "cpu" not in triton_devices():
        pytest.skip("needs Triton's interpreter on the CPU")
    vocab = 2 * BLOCK + 5
    probs = torch.softmax(torch.randn(2, vocab), -1)
    loss = soft_cross_entropy_fused(torch.full((3, vocab), 4.0), probs, torch.tensor([1, 0, 1]))
    torch.testing.assert_close(loss, torch.full((3,), float(torch.log(torch.tensor(vocab * 1.0)))))


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from training.soft_ce import BLOCK, _backward_kernel, _forward_kernel

for fn, types in (
    (_forward_kernel, {"z_ptr": "*bf16", "p_ptr": "*fp32", "at_ptr": "*i64", "loss_ptr": "*fp32",
                       "lse_ptr": "*fp32", "mass_ptr": "*fp32", "z_stride": "i32",
                       "p_stride": "i32", "vocab": "i32"}),
    (_backward_kernel, {"grad_ptr": "*fp32", "z_ptr": "*bf16", "p_ptr": "*fp32", "at_ptr": "*i64",
                        "lse_ptr": "*fp32", "mass_ptr": "*fp32", "dz_ptr": "*bf16",
                        "z_stride": "i32", "p_stride": "i32", "vocab": "i32"}),
):
    signature = {**types, "BLOCK": "constexpr"}
    triton.compile(ASTSource(fn=fn, signature=signature,
                             constexprs={(fn.arg_names.index("BLOCK"),): BLOCK}),
                   target=GPUTarget("cuda", 90, 32))
print("compiled")
"""


def test_the_kernels_compile_for_sm90():
    compile_outside_the_interpreter(COMPILE)
