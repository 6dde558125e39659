"""Triton kernels for the decoder layers and the `triton` attention backend, each next to the
torch reference it is tested against.

Owns the fused element-wise kernels (`norm`: RMSNorm and residual-add + RMSNorm; `rotary`: RoPE
on q and k fused with the K/V store into the KV pool; `activation`: SiLU-and-multiply) and the
paged-attention kernels (`decode_attention`, `few_query_attention`, `extend_attention`), and
the projections of one to four rows, fused with the norm or SiLU-and-multiply before them or,
for one row of a large weight, alone as a GEMV (`small_m_linear`); the LM head fused with the
argmax for rows that need only their greedy token (`greedy_head`); and when they launch with
programmatic dependent launch (`pdl`: in launches of up to four rows each starts while the
kernel before it runs). Each module exposes the
kernel (`name`) and its torch reference (`name_reference`), which defines the result; callers
choose (layers: `use_triton`, set by the runner for the triton attention backend). Kernels run
on CUDA tensors, and on CPU tensors under `TRITON_INTERPRET=1` (Triton's interpreter, which is
how CI runs them; it must be set before triton is imported).
"""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
