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

With a LoRA delta (`lora`, kernels.lora_segments.LoraDelta; prefill and mixed steps, whose rows come in segments
sharing an adapter), the qkv GEMM's output arrives without its adapters' share, and this kernel adds it first:

    qkv'[n, c] = round(qkv[n, c] + scale[slot_n] * t[s, n, :r] @ B[slot_n, :r, c])    r = rank[slot_n], s = c's slice

then rotates and stores qkv' as above: exactly what kernels.lora_expand and then this op compute, without the
expand's pass over qkv. At llama-8b, 16,384 prefill tokens, that pass wrote the 201 MB delta and the GEMM read it
back in its epilogue, which cost the GEMM +18% (engine/PERF.md, session 4): ~0.3 ms a layer. Here t and B add
~3 MB a row tile's worth of reads from L2. Grid (head, tile of BLOCK_M rows of one group, group), as the expand's:
the rows of a tile share a slot, so the delta is one tensor-core product per half-head (kernels.lora_expand's
`_tile_delta`). Rows without an adapter (slot -1) and empty slots are rotated and stored unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_expand import _BLOCK_R, consumer_block_m, with_delta_ref
from kernels.lora_segments import LoraDelta


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


@triton.jit
def _lora_half(acc, t_base, b_base, rows, m_mask, cols, rank, scale, stride_tm, stride_tr, stride_br, stride_bn,
               BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BM, D/2] fp32 + scale * t[rows, :rank] @ B[:rank, cols], with acc as the product's accumulator: the sum comes
    out in the tensor cores' layout and the rotation runs there, with no layout change of a [BM, D/2] tile."""
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
        r_mask = offs_r < rank
        tt = tl.load(t_base + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr, mask=m_mask[:, None] & r_mask[None, :],
                     other=0.0)  # [BM, BR] fp32  # fmt: skip
        bt = tl.load(b_base + offs_r[:, None] * stride_br + cols[None, :] * stride_bn, mask=r_mask[:, None], other=0.0)  # [BR, D/2]
        acc = tl.dot(tt * scale, bt.to(tl.float32), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _rope_cache_lora_kernel(
    qkv_ptr,  # [N, (H + 2 KV) D]
    pos_ptr,  # [N] int
    inv_freq_ptr,  # [D / 2] fp32
    q_ptr,  # [N, H, D] out
    k_cache_ptr,  # [slots, KV, D]
    v_cache_ptr,  # [slots, KV, D]
    slot_map_ptr,  # [N] int: cache slot of each token
    t_ptr,  # [3, N, R] fp32
    b_ptr,  # [adapter slots, R, (H + 2 KV) D]
    rank_ptr,  # [adapter slots]
    scale_ptr,  # [adapter slots] fp32
    group_slot_ptr,  # [G] adapter slot of each row group
    start_ptr,  # [G + 1], unused when HAS_START is False
    stride_qkv, stride_qn, stride_qh, stride_cs, stride_ch,
    stride_ti, stride_tm, stride_tr,
    stride_bs, stride_br, stride_bn,
    H: tl.constexpr,
    KV: tl.constexpr,
    HALF: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    group = tl.program_id(1)
    slot = tl.load(group_slot_ptr + group)
    if HAS_START:
        row_begin = tl.load(start_ptr + group)
        row_end = tl.load(start_ptr + group + 1)
    else:
        row_begin = group
        row_end = group + 1
    m0 = row_begin + pid_m * BLOCK_M
    if m0 >= row_end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < row_end
    rows = offs_m.to(tl.int64)
    j = tl.arange(0, HALF)  # [D/2]
    rank = tl.where(slot >= 0, tl.load(rank_ptr + tl.maximum(slot, 0)), 0)  # no adapter: rank 0, no product at all
    scale = tl.load(scale_ptr + tl.maximum(slot, 0)).to(tl.float32)
    b_base = b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bs
    # cos and sin once per row tile, for every head (per head, their transcendentals cost more than the whole plain op)
    pos = tl.load(pos_ptr + rows, mask=m_mask, other=0).to(tl.float32)  # [BM]
    angle = pos[:, None] * tl.load(inv_freq_ptr + j)[None, :]  # [BM, D/2]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    cache = tl.load(slot_map_ptr + rows, mask=m_mask, other=0).to(tl.int64)  # [BM]
    row_ptrs = qkv_ptr + rows[:, None] * stride_qkv + j[None, :]  # [BM, D/2] first half of head 0

    t_q = t_ptr
    for h in range(H):
        _lora_rope_head(row_ptrs, h * (2 * HALF), t_q, b_base, q_ptr + rows[:, None] * stride_qn + h * stride_qh + j[None, :], rows,
                        m_mask, j, cos, sin, rank, scale, stride_tm, stride_tr, stride_br, stride_bn, True, HALF, BLOCK_R,
                        DOT_PRECISION)  # fmt: skip
    for h in range(KV):
        _lora_rope_head(row_ptrs, (H + h) * (2 * HALF), t_q + stride_ti, b_base,
                        k_cache_ptr + cache[:, None] * stride_cs + h * stride_ch + j[None, :], rows, m_mask, j, cos, sin, rank, scale,
                        stride_tm, stride_tr, stride_br, stride_bn, True, HALF, BLOCK_R, DOT_PRECISION)  # fmt: skip
    for h in range(KV):
        _lora_rope_head(row_ptrs, (H + KV + h) * (2 * HALF), t_q + 2 * stride_ti, b_base,
                        v_cache_ptr + cache[:, None] * stride_cs + h * stride_ch + j[None, :], rows, m_mask, j, cos, sin, rank, scale,
                        stride_tm, stride_tr, stride_br, stride_bn, False, HALF, BLOCK_R, DOT_PRECISION)  # fmt: skip


@triton.jit
def _lora_rope_head(row_ptrs, col, t_base, b_base, out_ptrs, rows, m_mask, j, cos, sin, rank, scale, stride_tm, stride_tr, stride_br,
                    stride_bn, ROTATE: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One head of a row tile: its two halves plus their LoRA delta, rounded to the activations' dtype as the expand
    rounds y, then rotated (q and k) or not (v), and stored at out_ptrs [BM, D/2] (first half; the second follows)."""
    x1 = tl.load(row_ptrs + col, mask=m_mask[:, None], other=0.0)
    x2 = tl.load(row_ptrs + col + HALF, mask=m_mask[:, None], other=0.0)
    a = _lora_half(x1.to(tl.float32), t_base, b_base, rows, m_mask, col + j, rank, scale, stride_tm, stride_tr, stride_br, stride_bn,
                   BLOCK_R, DOT_PRECISION).to(x1.dtype).to(tl.float32)  # fmt: skip
    b = _lora_half(x2.to(tl.float32), t_base, b_base, rows, m_mask, col + HALF + j, rank, scale, stride_tm, stride_tr, stride_br,
                   stride_bn, BLOCK_R, DOT_PRECISION).to(x2.dtype).to(tl.float32)  # fmt: skip
    if ROTATE:
        tl.store(out_ptrs, (a * cos - b * sin).to(out_ptrs.dtype.element_ty), mask=m_mask[:, None])
        tl.store(out_ptrs + HALF, (b * cos + a * sin).to(out_ptrs.dtype.element_ty), mask=m_mask[:, None])
    else:
        tl.store(out_ptrs, a.to(out_ptrs.dtype.element_ty), mask=m_mask[:, None])
        tl.store(out_ptrs + HALF, b.to(out_ptrs.dtype.element_ty), mask=m_mask[:, None])


def rope_and_cache(
    qkv: torch.Tensor,  # [N, (H + 2 KV) * D]
    positions: torch.Tensor,  # [N] int
    inv_freq: torch.Tensor,  # [D / 2] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D]
    slot_mapping: torch.Tensor,  # [N] int: flat cache slot of each token
    num_heads: int,
    lora: LoraDelta | None = None,  # qkv's LoRA delta, added before the rotation (see Semantics)
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
    if lora is not None:
        _launch_lora(qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping, num_heads, lora)
        return q
    _rope_cache_kernel[(n,)](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), q.stride(0), q.stride(1), kv_heads * head_dim, head_dim,
        H=num_heads, KV=kv_heads, HALF=head_dim // 2,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KV=triton.next_power_of_2(kv_heads), num_warps=4,
    )  # fmt: skip
    return q


def _launch_lora(qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping, num_heads, lora: LoraDelta) -> None:
    n = qkv.shape[0]
    _, _, kv_heads, head_dim = k_cache.shape
    t, b, seg = lora.t, lora.b_stack, lora.segments
    widths = (num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim)
    assert tuple(lora.slices) == widths, f"qkv's LoRA slices {lora.slices} are not q, k, v of {widths}"
    assert t.shape == (3, n, b.shape[1]) and t.dtype == torch.float32, (tuple(t.shape), t.dtype, n, tuple(b.shape))
    assert b.shape[2] == qkv.shape[1] and b.dtype == qkv.dtype, (tuple(b.shape), tuple(qkv.shape), b.dtype, qkv.dtype)
    assert seg.num_rows == n, f"segments cover {seg.num_rows} rows, qkv has {n}"
    block_m, num_warps = _config(seg)
    grid = (triton.cdiv(max(seg.max_len, 1), block_m), seg.num_groups)
    start = seg.start if seg.start is not None else seg.slot  # placeholder, never read
    _rope_cache_lora_kernel[grid](
        qkv, positions, inv_freq, q, k_cache, v_cache, slot_mapping,
        t, b, lora.rank, lora.scale, seg.slot, start,
        qkv.stride(0), q.stride(0), q.stride(1), kv_heads * head_dim, head_dim,
        t.stride(0), t.stride(1), t.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        H=num_heads, KV=kv_heads, HALF=head_dim // 2, HAS_START=seg.start is not None,
        BLOCK_M=block_m, BLOCK_R=_BLOCK_R, DOT_PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip


def _config(segments) -> tuple[int, int]:
    """(BLOCK_M, num_warps) of the LoRA form for these row groups."""
    return min(32, consumer_block_m(segments.max_len)), 4


def rope_and_cache_ref(qkv, positions, inv_freq, k_cache, v_cache, slot_mapping, num_heads, lora: LoraDelta | None = None) -> torch.Tensor:
    """Pure torch, fp32 products rounded once: what the kernel computes, the caches written in place (the LoRA delta
    added to qkv first, in fp32 and rounded once, as kernels.lora_expand_ref would)."""
    n = qkv.shape[0]
    _, _, kv_heads, d = k_cache.shape
    if lora is not None:
        qkv = with_delta_ref(qkv, lora)
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
