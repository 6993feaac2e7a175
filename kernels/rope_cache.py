"""Rotary embedding of q and k and the KV-cache write of k and v, in one launch per layer.

Semantics, for every token n of the flat batch, from the fused projection `qkv [N, (H + 2 KV) * D]`
(rows [q | k | v], engine.model) and the token's position p = positions[n]:

    angle_j = p * inv_freq[j]                                    j = 0 .. D/2 - 1, fp32
    rot(x)  = [x1 cos - x2 sin, x2 cos + x1 sin]                 x1, x2 the halves of a head (HF's rotate_half)
    q_out[n, h]                    = rot(q[n, h])                h < H
    k_cache[slot_mapping[n], kv]   = rot(k[n, kv])               kv < KV
    v_cache[slot_mapping[n], kv]   = v[n, kv]

with the caches viewed as [num_blocks * block_size, KV, D] (engine.kv_cache) and the products in fp32,
rounded once when stored. cos and sin are computed here from the positions in fp32, so no [N, D] tables
are built per step.

Why one kernel: unfused this is cos/sin tables (4 launches per step), three passes for the rotation of q
and k, and two index_copy_ launches for the cache: five launches per layer, each 2-3 µs at decode batch
sizes, 80 of a llama-1b decode step's ~270. Fused: one, reading qkv once and writing q, k and v once.

One program per token: H + 2 KV heads of D values (llama-8b: 48 x 128), loaded as [heads, D/2] halves.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import next_power_of_2


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,  # [N, (H + 2 KV) D]
    pos_ptr,  # [N] int
    inv_freq_ptr,  # [D / 2] fp32
    q_ptr,  # [N, H, D] out
    k_cache_ptr,  # [slots, KV, D]
    v_cache_ptr,  # [slots, KV, D]
    slot_ptr,  # [N] int
    stride_qkv, stride_qn, stride_qh, stride_cs, stride_ch,
    H: tl.constexpr,
    KV: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HALF)  # [D/2]
    angle = tl.load(pos_ptr + tok).to(tl.float32) * tl.load(inv_freq_ptr + j)  # [D/2]
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    row = qkv_ptr + tok * stride_qkv
    slot = tl.load(slot_ptr + tok).to(tl.int64)

    h = tl.arange(0, BLOCK_H)[:, None]  # [BH, 1]
    hm = h < H
    x1 = tl.load(row + h * (2 * HALF) + j[None, :], mask=hm, other=0.0).to(tl.float32)  # [BH, D/2]
    x2 = tl.load(row + h * (2 * HALF) + HALF + j[None, :], mask=hm, other=0.0).to(tl.float32)
    q_out = q_ptr + tok * stride_qn + h * stride_qh + j[None, :]
    tl.store(q_out, (x1 * cos - x2 * sin).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(q_out + HALF, (x2 * cos + x1 * sin).to(q_ptr.dtype.element_ty), mask=hm)

    kh = tl.arange(0, BLOCK_KV)[:, None]  # [BKV, 1]
    km = kh < KV
    k_row = row + (H + kh) * (2 * HALF)
    k1 = tl.load(k_row + j[None, :], mask=km, other=0.0).to(tl.float32)
    k2 = tl.load(k_row + HALF + j[None, :], mask=km, other=0.0).to(tl.float32)
    k_out = k_cache_ptr + slot * stride_cs + kh * stride_ch + j[None, :]
    tl.store(k_out, (k1 * cos - k2 * sin).to(k_cache_ptr.dtype.element_ty), mask=km)
    tl.store(k_out + HALF, (k2 * cos + k1 * sin).to(k_cache_ptr.dtype.element_ty), mask=km)

    v_row = row + (H + KV + kh) * (2 * HALF)
    v_out = v_cache_ptr + slot * stride_cs + kh * stride_ch + j[None, :]
    tl.store(v_out, tl.load(v_row + j[None, :], mask=km, other=0.0), mask=km)
    tl.store(v_out + HALF, tl.load(v_row + HALF + j[None, :], mask=km, other=0.0), mask=km)


def rope_and_cache(
    qkv: torch.Tensor,  # [N, (H + 2 KV) * D]
    positions: torch.Tensor,  # [N] int
    inv_freq: torch.Tensor,  # [D / 2] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [N] int: flat cache slot of each token
    num_heads: int,
) -> torch.Tensor:  # [N, H, D] rotated queries
    """Rotate q and k, write k and v into the caches at each token's slot, return q (see Semantics)."""
    n = qkv.shape[0]
    _, _, kv_heads, head_dim = k_cache.shape
    assert qkv.shape[1] == (num_heads + 2 * kv_heads) * head_dim and qkv.stride(1) == 1, (tuple(qkv.shape), num_heads, kv_heads)
    assert head_dim % 2 == 0 and (head_dim & (head_dim - 1)) == 0, f"head_dim {head_dim}: the kernel takes powers of two"
    assert positions.shape == slot_mapping.shape == (n,) and inv_freq.shape == (head_dim // 2,), (positions.shape, inv_freq.shape)
    assert v_cache.shape == k_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty(n, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if n == 0:
        return q
    _rope_cache_kernel[(n,)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), kv_heads * head_dim, head_dim,
        H=num_heads, KV=kv_heads, HALF=head_dim // 2,
        BLOCK_H=next_power_of_2(num_heads), BLOCK_KV=next_power_of_2(kv_heads), num_warps=4,
    )  # fmt: skip
    return q


def rope_and_cache_ref(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads) -> torch.Tensor:
    """Pure torch, fp32 products rounded once: what the kernel computes, the caches written in place."""
    n = qkv.shape[0]
    _, _, kv_heads, d = k_cache.shape
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [N, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]  # [N, 1, D/2]

    def rot(x: torch.Tensor) -> torch.Tensor:  # [N, heads, D] -> same, in x's dtype
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    heads = qkv.view(n, num_heads + 2 * kv_heads, d)
    q = rot(heads[:, :num_heads])
    k_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping.long(), rot(heads[:, num_heads : num_heads + kv_heads]))
    v_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping.long(), heads[:, num_heads + kv_heads :])
    return q
