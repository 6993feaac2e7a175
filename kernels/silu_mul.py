"""The gated MLP's activation in one pass: `out = silu(gate) * up` from the fused `gate_up [N, 2 I]`.

Semantics: out[n, i] = g / (1 + exp(-g)) * u with g = gate_up[n, i], u = gate_up[n, I + i], in fp32,
rounded once when stored. Unfused (F.silu, then a product) it is two launches and an [N, I] intermediate
written and read back; at llama-8b prefill (16k tokens, I = 14336) that intermediate is 470 MB each way.

Grid: (row, column tile of BLOCK columns).

With a LoRA delta (`lora`, kernels.lora_segments.LoraDelta; prefill and mixed steps, rows in segments sharing an
adapter), the gate_up GEMM's output arrives without its adapters' share, and this kernel adds it first:

    g' = round(g + scale * t[0, n, :r_g] @ B_gate[slot_n, :r_g, i]),  u' = round(u + scale * t[1, n, :r_u] @ B_up[slot_n, :r_u, i])

with B's rows read through the slot's page tables (kernels.lora_segments.LoraPages) and r_g, r_u the adapter's rank on
gate and on up (0 where it does not target that projection),

then out = silu(g') * u': what kernels.lora_expand and then this op compute, without the expand's pass over gate_up.
At llama-8b, 16,384 prefill tokens, that pass wrote a 940 MB delta a layer for the GEMM to read back in its epilogue.
Grid (column tile, tile of BLOCK_M rows of one group, group), as the expand's: a tile's rows share a slot, so each
half's delta is one tensor-core product per rank step, and g and u are that product's accumulators: the sums come out
in the tensor cores' layout and the activation runs there, with no layout change of the [BM, BN] tiles. Rows without an
adapter (slot -1) and empty slots run no product and take the plain activation.

On an H200 (kernels.bench.probes.probe_consumers, 8b, 32 x 512 tokens, 32 adapters of rank 16; engine/PERF.md, Session 5):
this op 639 µs against 341 plain (32 x 256 tiles, 8 warps, the best of 18 configs; an H100 preferred 128 x 64 tiles
where groups are long, `_config`); GEMM + shrink + this op took +20.8%
over GEMM + plain op, the delta written first and the GEMM adding into it +22.5%. qkv keeps the delta-first order
(engine/PERF.md, "Tried and set aside": added by RoPE + the KV write, its delta costs more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraDelta, with_delta_ref
from kernels.utils import BLOCK_R, cdiv, group_rows, next_power_of_2

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_lora_kernel(
    gu_ptr,  # [N, 2 I]
    out_ptr,  # [N, I]
    t_ptr,  # [2, N, R] fp32
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [adapter slots, 2, R] int64: gate's and up's page tables
    rank_ptr,  # [adapter slots, 2]: gate's and up's ranks (0 where not targeted)
    scale_ptr,  # [adapter slots] fp32
    group_slot_ptr,  # [G]
    start_ptr,  # [G + 1], unused when HAS_START is False
    inter,
    b_offset,  # this layer's B row inside a page (both slices are I wide)
    stride_gu, stride_o,
    stride_ti, stride_tm, stride_tr,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    HAS_START: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(group_slot_ptr + group)
    row_begin, row_end = group_rows(start_ptr, group, HAS_START)
    m0 = row_begin + pid_m * BLOCK_M
    if m0 >= row_end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < row_end
    rows = offs_m.to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_mask = cols < inter
    mask = m_mask[:, None] & n_mask[None, :]
    g_ptrs = gu_ptr + rows[:, None] * stride_gu + cols[None, :]  # [BM, BN]
    g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(g_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    safe = tl.maximum(slot, 0).to(tl.int64)
    rank_g = tl.where(slot >= 0, tl.load(rank_ptr + safe * stride_rs), 0)  # no adapter: rank 0, no product at all
    rank_u = tl.where(slot >= 0, tl.load(rank_ptr + safe * stride_rs + stride_ri), 0)
    scale = tl.load(scale_ptr + safe).to(tl.float32)
    pages_g = page_ptr + safe * stride_ps  # gate's page table; up's is one slice on
    pool_b = pool_ptr + b_offset
    # g and u are the products' accumulators: the sums come out in the tensor cores' layout and the activation runs
    # there, with no layout change of the [BM, BN] tiles (as a separate delta tile added to g would need).
    for r0 in range(0, tl.maximum(rank_g, rank_u), BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
        rg_mask = offs_r < rank_g
        ru_mask = offs_r < rank_u
        t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr  # [BM, BR]
        tg = tl.load(t_ptrs, mask=m_mask[:, None] & rg_mask[None, :], other=0.0) * scale
        tu = tl.load(t_ptrs + stride_ti, mask=m_mask[:, None] & ru_mask[None, :], other=0.0) * scale
        pg = tl.load(pages_g + offs_r * stride_pr, mask=rg_mask, other=0)  # [BR] int64
        pu = tl.load(pages_g + stride_pi + offs_r * stride_pr, mask=ru_mask, other=0)
        bg = tl.load(pool_b + pg[:, None] + cols[None, :], mask=rg_mask[:, None] & n_mask[None, :], other=0.0)  # [BR, BN]
        bu = tl.load(pool_b + pu[:, None] + cols[None, :], mask=ru_mask[:, None] & n_mask[None, :], other=0.0)
        g = tl.dot(tg, bg.to(tl.float32), g, input_precision=DOT_PRECISION)
        u = tl.dot(tu, bu.to(tl.float32), u, input_precision=DOT_PRECISION)
    g = g.to(out_ptr.dtype.element_ty).to(tl.float32)  # rounded as the expand rounds y
    u = u.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:  # [N, 2 I] -> [N, I]
    """silu(gate) * up of the fused projection's output, its LoRA delta added first if given (see Semantics)."""
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1, (tuple(gate_up.shape), gate_up.stride())
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    if lora is not None:
        _launch_lora(gate_up, out, lora)
        return out
    block = min(_BLOCK, next_power_of_2(inter))
    _silu_mul_kernel[(n, cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


def _launch_lora(gate_up: torch.Tensor, out: torch.Tensor, lora: LoraDelta) -> None:
    n, inter = out.shape
    t, w, seg = lora.t, lora.weights, lora.segments
    assert tuple(w.slices) == (inter, inter), f"gate_up's LoRA slices {w.slices} are not gate, up of {inter} each"
    assert t.shape == (2, n, w.max_rank) and t.dtype == torch.float32, (tuple(t.shape), t.dtype, n, w.max_rank)
    assert w.pool.dtype == gate_up.dtype, (w.pool.dtype, gate_up.dtype)
    w.check(gate_up.device)
    assert seg.num_rows == n, f"segments cover {seg.num_rows} rows, gate_up has {n}"
    assert w.b_offset(0) == w.b_offset(1), (w.b_offset(0), w.b_offset(1))
    block_m, block_n, num_warps = _config(seg)
    block_n = min(block_n, next_power_of_2(inter))
    grid = (cdiv(inter, block_n), cdiv(max(seg.max_len, 1), block_m), seg.num_groups)
    start = seg.start if seg.start is not None else seg.slot  # placeholder, never read
    _silu_mul_lora_kernel[grid](
        gate_up, out, t, w.pool, w.pages, w.rank, w.scale, seg.slot, start, inter, w.b_offset(0),
        gate_up.stride(0), out.stride(0),
        t.stride(0), t.stride(1), t.stride(2),
        w.pages.stride(0), w.pages.stride(1), w.pages.stride(2),
        w.rank.stride(0), w.rank.stride(1),
        HAS_START=seg.start is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=BLOCK_R,
        DOT_PRECISION="ieee" if gate_up.dtype == torch.float32 else "tf32", num_warps=num_warps,
    )  # fmt: skip


def _config(segments) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the LoRA form. Where groups are long (a prefill's sequences, 64 rows or more on
    average): 128 x 64 tiles at 8 warps, the best of 18 on an H100 at both shapes (kernels.bench.probes.probe_consumers;
    engine/PERF.md, session 19): 8b (32 x 512 tokens) 934.2 µs against 1244.3 with 32 x 256, 1b (32 x 128) 152.5 against
    204.2 (the plain op: 475.7 and 76.2). Otherwise 32 x 256 tiles at 8 warps, the best of 18 on an H200 at 8b and 1b
    prefill (module docstring), fewer rows for short groups (decode rows of a mixed step), 16 at least, the tensor-core
    minimum of the delta's product: a 128-row tile over a one-row group would be all padding."""
    if segments.num_rows >= 64 * max(1, segments.num_groups):
        return 128, 64, 8
    return max(16, min(32, next_power_of_2(max(segments.max_len, 1)))), 256, 8


def silu_mul_ref(gate_up: torch.Tensor, lora: LoraDelta | None = None) -> torch.Tensor:  # [N, 2 I] -> [N, I]
    """Pure torch in fp32, rounded once; the LoRA delta added to gate_up first, rounded once, as the expand would."""
    if lora is not None:
        gate_up = with_delta_ref(gate_up, lora)
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
