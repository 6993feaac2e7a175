"""The gated MLP's activation in one pass: `out = silu(gate) * up` from the fused `gate_up [N, 2 I]`.

Semantics: out[n, i] = g / (1 + exp(-g)) * u with g = gate_up[n, i], u = gate_up[n, I + i], in fp32,
rounded once when stored. Unfused (F.silu, then a product) it is two launches and an [N, I] intermediate
written and read back; at llama-8b prefill (16k tokens, I = 14336) that intermediate is 470 MB each way.

Grid: (row, column tile of BLOCK columns).

`silu_mul_lora`, for CUDA-graph decode steps with adapters (one row per group): the same op with the LoRA around it
folded in, so a decode layer's MLP launches two LoRA kernels fewer (the gate_up expand and the down shrink):

    g' = round(g + scale[slot] * t_gu[0, n, :r] @ B_gu[slot, :r, i])          (the gate_up expand, rounded as it
    u' = round(u + scale[slot] * t_gu[1, n, :r] @ B_gu[slot, :r, I + i])       rounds y; rows without an adapter:
    out[n, i] = round(silu(g') * u')                                           g' = g, u' = u)
    t_down[0, n, :r] += out[n, cols] @ A_down[slot, 0, :r, cols]^T             (the down shrink, fp32 atomics per
                                                                               column tile into a zeroed t_down)

with r = rank[slot] (each row at its own rank). Each program reads its columns' B rows of the row's adapter and
A_down's, so the adapters' bytes are those of the two kernels it replaces; what goes is two launches and the
round trip of gate_up's delta through memory. Measured against the separate launches in engine/PERF.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024
_LORA_BLOCK, _BLOCK_R = 256, 16  # silu_mul_lora: [16, 256] tiles of B and A per rank step


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (g / (1.0 + tl.exp(-g)) * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2 I] -> [N, I]
    """silu(gate) * up of the fused projection's output (see Semantics)."""
    n, two_i = gate_up.shape
    assert two_i % 2 == 0 and gate_up.stride(1) == 1, (tuple(gate_up.shape), gate_up.stride())
    inter = two_i // 2
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4)
    return out


@triton.jit
def _silu_mul_lora_kernel(
    gu_ptr,  # [N, 2 I] the base gate_up projection
    out_ptr,  # [N, I]
    t_gu_ptr,  # [2, N, R] fp32: the gate_up shrink
    b_ptr,  # [slots, R, 2 I]
    a_ptr,  # [slots, 1, R, I]: down's A
    t_down_ptr,  # [1, N, R] fp32, added into
    rank_ptr,  # [slots]
    scale_ptr,  # [slots] fp32
    slot_ptr,  # [N]
    inter,
    stride_gu, stride_o,
    stride_ti, stride_tm,
    stride_bs, stride_br,
    stride_as, stride_ar,
    stride_dm,
    BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    slot = tl.load(slot_ptr + row)
    s = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.where(slot >= 0, tl.load(rank_ptr + s), 0)  # no adapter: rank 0
    scale = tl.load(scale_ptr + s).to(tl.float32)
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)

    dg = tl.zeros((BLOCK,), dtype=tl.float32)
    du = tl.zeros((BLOCK,), dtype=tl.float32)
    b_rows = b_ptr + s * stride_bs
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
        r_mask = offs_r < rank
        tg = tl.load(t_gu_ptr + row * stride_tm + offs_r, mask=r_mask, other=0.0)  # [BR] fp32
        tu = tl.load(t_gu_ptr + stride_ti + row * stride_tm + offs_r, mask=r_mask, other=0.0)
        both = r_mask[:, None] & mask[None, :]
        bg = tl.load(b_rows + offs_r[:, None] * stride_br + cols[None, :], mask=both, other=0.0)  # [BR, BLOCK]
        bu = tl.load(b_rows + offs_r[:, None] * stride_br + inter + cols[None, :], mask=both, other=0.0)
        dg += tl.sum(tg[:, None] * bg.to(tl.float32), axis=0)
        du += tl.sum(tu[:, None] * bu.to(tl.float32), axis=0)
    if rank > 0:  # as the expand: y + delta rounded once; rows without an adapter keep their bits (-0.0 too)
        g = (g.to(tl.float32) + scale * dg).to(g.dtype)
        u = (u.to(tl.float32) + scale * du).to(u.dtype)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf)) * u.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, act, mask=mask)

    actf = act.to(tl.float32)  # the down shrink reads what was stored, as it would from memory
    a_rows = a_ptr + s * stride_as
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        at = tl.load(a_rows + offs_r[:, None] * stride_ar + cols[None, :], mask=r_mask[:, None] & mask[None, :], other=0.0)
        tl.atomic_add(t_down_ptr + row * stride_dm + offs_r, tl.sum(at.to(tl.float32) * actf[None, :], axis=1), mask=r_mask)


def silu_mul_lora(
    gate_up: torch.Tensor,  # [N, 2 I] the base projection's output (no LoRA delta yet)
    t_gu: torch.Tensor,  # [2, N, R] fp32: gate_up's shrink (kernels.lora_shrink), per row at its rank
    b_gu: torch.Tensor,  # [slots, R, 2 I] gate_up's B, rank-major, [gate | up] side by side
    a_down: torch.Tensor,  # [slots, 1, R, I] down's A
    t_down: torch.Tensor,  # [1, N, R] fp32, zeroed by the caller: down's shrink is added into it
    rank: torch.Tensor,  # [slots] int
    scale: torch.Tensor,  # [slots] fp32
    slot: torch.Tensor,  # [N] int: each row's slot, -1 for none
) -> torch.Tensor:  # [N, I]
    """silu(gate + delta) * (up + delta), and down's shrink of the result added into t_down (see the module docstring)."""
    n, two_i = gate_up.shape
    inter = two_i // 2
    slots, max_rank = b_gu.shape[0], b_gu.shape[1]
    assert two_i % 2 == 0 and gate_up.stride(1) == 1, (tuple(gate_up.shape), gate_up.stride())
    assert b_gu.shape == (slots, max_rank, two_i) and b_gu.stride(2) == 1 and b_gu.dtype == gate_up.dtype, (tuple(b_gu.shape), b_gu.dtype)
    assert a_down.shape == (slots, 1, max_rank, inter) and a_down.stride(3) == 1 and a_down.dtype == gate_up.dtype, tuple(a_down.shape)
    assert t_gu.shape == (2, n, max_rank) and t_gu.dtype == torch.float32 and t_gu.stride(2) == 1, (tuple(t_gu.shape), t_gu.dtype)
    assert t_down.shape == (1, n, max_rank) and t_down.dtype == torch.float32 and t_down.stride(2) == 1, (tuple(t_down.shape), t_down.dtype)
    assert slot.shape == (n,) and rank.shape == scale.shape == (slots,), (tuple(slot.shape), tuple(rank.shape), tuple(scale.shape))
    out = torch.empty(n, inter, dtype=gate_up.dtype, device=gate_up.device)
    if n == 0:
        return out
    block = min(_LORA_BLOCK, triton.next_power_of_2(inter))
    _silu_mul_lora_kernel[(n, triton.cdiv(inter, block))](
        gate_up, out, t_gu, b_gu, a_down, t_down, rank, scale, slot, inter,
        gate_up.stride(0), out.stride(0), t_gu.stride(0), t_gu.stride(1), b_gu.stride(0), b_gu.stride(1),
        a_down.stride(0), a_down.stride(2), t_down.stride(1),
        BLOCK=block, BLOCK_R=_BLOCK_R, num_warps=4,
    )  # fmt: skip
    return out


def silu_mul_lora_ref(gate_up, t_gu, b_gu, a_down, t_down, rank, scale, slot) -> torch.Tensor:  # [N, I]
    """Pure torch in fp32, row by row at each row's rank; t_down is added into as the kernel does."""
    inter = gate_up.shape[1] // 2
    g, u = gate_up[:, :inter].clone(), gate_up[:, inter:].clone()
    for row, s in enumerate(slot.tolist()):
        r = int(rank[s]) if s >= 0 else 0
        if r:
            g[row] = (g[row].float() + float(scale[s]) * (t_gu[0, row, :r] @ b_gu[s, :r, :inter].float())).to(g.dtype)
            u[row] = (u[row].float() + float(scale[s]) * (t_gu[1, row, :r] @ b_gu[s, :r, inter:].float())).to(u.dtype)
    out = (torch.nn.functional.silu(g.float()) * u.float()).to(gate_up.dtype)
    for row, s in enumerate(slot.tolist()):
        r = int(rank[s]) if s >= 0 else 0
        if r:
            t_down[0, row, :r] += a_down[s, 0, :r].float() @ out[row].float()
    return out


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # [N, 2 I] -> [N, I]
    """Pure torch in fp32, rounded once."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(g) * u).to(gate_up.dtype)
