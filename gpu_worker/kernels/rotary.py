"""RoPE on q and k fused with the K/V store: the step between the qkv projection and attention."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gpu_worker.kernels import next_power_of_2, pdl
from gpu_worker.kernels.norm import rms_norm_reference


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, D], cos/sin [n, D/2] float32 -> rotated x in x's dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_and_store_kv_reference(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    n, head_dim = qkv.shape[0], k_buffer.shape[-1]
    kv_width = num_kv_heads * head_dim
    q, k, v = qkv.split([num_heads * head_dim, kv_width, kv_width], dim=-1)
    q = q.reshape(n, num_heads, head_dim)
    k = k.reshape(n, num_kv_heads, head_dim)
    if q_norm is not None:
        q, k = rms_norm_reference(q, q_norm, eps), rms_norm_reference(k, k_norm, eps)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)
    q, k = rotate_reference(q, cos, sin), rotate_reference(k, cos, sin)
    loc = out_cache_loc.long()
    k_buffer[loc] = k.to(k_buffer.dtype)
    v_buffer[loc] = v.reshape(n, num_kv_heads, head_dim).to(v_buffer.dtype)
    return q.reshape(n, num_heads * head_dim)


@triton.jit
def rotate_halves(x1, x2, cos, sin, w1, w2, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr):
    """Rows of halves [R, BLOCK_HALF] -> rotated halves in float32, after an optional
    per-row RMSNorm (weights w1, w2 [BLOCK_HALF]) with transformers' roundings. cos / sin:
    [1, BLOCK_HALF] (one position for every row) or [R, BLOCK_HALF] (a position per row).
    Shared with the fused attention kernels."""
    dtype = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / HEAD_DIM + eps)[:, None]
        f1 = ((f1 * inv).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
        f2 = ((f2 * inv).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    return f1 * cos - f2 * sin, f2 * cos + f1 * sin


@triton.jit
def _rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    cache_ptr,
    k_buffer_ptr,
    v_buffer_ptr,
    loc_ptr,
    q_out_ptr,
    q_norm_ptr,
    k_norm_ptr,
    qkv_stride,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.wait_for_previous(USE_PDL)  # everything it reads may come from the kernel before
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_DIM // 2
    c = tl.arange(0, HALF_BLOCK)
    c_mask = c < half
    cols, mask = c[None, :], c_mask[None, :]  # one row of halves, as rotate_halves takes them
    is_q = head < NUM_HEADS
    base = qkv_ptr + token * qkv_stride + head * HEAD_DIM
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + half + cols, mask=mask, other=0.0)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + position * HEAD_DIM + c, mask=c_mask, other=0.0)
    sin = tl.load(cache_ptr + position * HEAD_DIM + half + c, mask=c_mask, other=0.0)
    w1, w2 = cos, cos  # unused without norms
    if HAS_NORM:
        w1 = tl.where(
            is_q,
            tl.load(q_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32),
            tl.load(k_norm_ptr + c, mask=c_mask, other=0.0).to(tl.float32),
        )
        w2 = tl.where(
            is_q,
            tl.load(q_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32),
            tl.load(k_norm_ptr + half + c, mask=c_mask, other=0.0).to(tl.float32),
        )
    out1, out2 = rotate_halves(x1, x2, cos[None, :], sin[None, :], w1, w2, eps, HEAD_DIM, HAS_NORM)
    if is_q:
        q_base = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
        tl.store(q_base + cols, out1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_base + half + cols, out2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(loc_ptr + token).to(tl.int64)
        k_base = k_buffer_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        tl.store(k_base + cols, out1.to(k_buffer_ptr.dtype.element_ty), mask=mask)
        tl.store(k_base + half + cols, out2.to(k_buffer_ptr.dtype.element_ty), mask=mask)
        v_src = qkv_ptr + token * qkv_stride + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v_dst = v_buffer_ptr + (slot * NUM_KV_HEADS + kv_head) * HEAD_DIM
        v1 = tl.load(v_src + cols, mask=mask, other=0.0)
        v2 = tl.load(v_src + half + cols, mask=mask, other=0.0)
        tl.store(v_dst + cols, v1.to(v_buffer_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst + half + cols, v2.to(v_buffer_ptr.dtype.element_ty), mask=mask)


def rope_and_store_kv(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """qkv [n, (H + 2*KH) * D], the merged projection's output (q, k, then v heads). Each q
    and k head is optionally RMS-normalised with its own weight [D] (Qwen3), then rotated
    (rotate-half, in float32) by its token's position from cos_sin_cache [max_positions, D]
    (cos | sin, float32); k and v are stored in place at out_cache_loc [n] in k_buffer /
    v_buffer [num_slots, KH, D] (contiguous). Returns the rotated q, a new [n, H * D]."""
    n, head_dim = qkv.shape[0], k_buffer.shape[-1]
    q = torch.empty(n, num_heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    if n:
        has_norm = q_norm is not None
        _rope_store_kernel[(n, num_heads + num_kv_heads)](
            qkv,
            positions,
            cos_sin_cache,
            k_buffer,
            v_buffer,
            out_cache_loc,
            q,
            q_norm if has_norm else q,
            k_norm if has_norm else q,
            qkv.stride(0),
            eps,
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HALF_BLOCK=next_power_of_2(head_dim // 2),
            HAS_NORM=has_norm,
            num_warps=1,
            **pdl.launch_args(qkv.device, n),
        )
    return q
