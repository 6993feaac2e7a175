"""A decode step's projection in one launch: `y = x W^T (+ bias)`, plus each row's own LoRA delta, for a few rows.

Semantics: y[m, n] = sum_k x[m, k] W[n, k] + bias[n] + scale[slot_m] * sum_{r < rank[slot_m, s]} t[s, m, r] B[slot_m, s, r, n]
for M <= 64 rows, where s is the fused slice holding column n and t = x A^T is the shrink's output
(kernels/lora_shrink.py); rows with slot -1 or an empty slot get no delta. Sums in fp32, y rounded once.

Why: a decode step at batch 32 is bound by reading the weights, and at that size cuBLAS streamed them at
~2.9 TB/s of the H200's ~4.3 (engine/PERF.md, "where the device time goes": llama-1b qkv and o 6.4 µs each, 1.3-2.0
TB/s), and a separate LoRA expand is a launch of its own per projection (64 at llama-1b, ~4.5 µs each, bound by
launch latency, not bytes). Here each program streams a [BLOCK_N, K] panel of W against all M rows (x
comes from L2: 32 rows of 2-8k columns), then adds the panel's LoRA columns for every row: the rank loop
gathers each row's B rows [R, BLOCK_N] (rank-major, contiguous along n) at the row's true rank, so mixed
ranks cost their own bytes. One graph launch instead of two, and the delta never makes a round trip
through y. The shrink stays a launch of its own: it must finish before any program adds its result.
Outcome on the H200 (`_TUNED`): faster than cuBLAS + the expand only at llama-8b's o and down, whose K loops
are long; at llama-1b no faster than cuBLAS, and the delta's gather after the K loop is a tail about as long
as the launch it saves. The engine uses it only where it won.

Grid: (N / BLOCK_N,), one program per output panel, no split of K, so no reduction pass: BLOCK_N is small
enough that the grid covers the SMs (llama-8b o and down, N = 4096 at the swept BLOCK_N 32: 128 programs;
untuned shapes take the widest of 64/32/16 that gives 128). A panel never straddles two fused slices (the
launcher checks that every slice starts on a BLOCK_N boundary), so a program reads one slice's t.

Interpreter: on CPU (the Triton interpreter) the dot operands are widened to fp32, since the interpreter
multiplies the raw bit patterns of bf16 in `tl.dot` (triton-lang/triton#11584); on CUDA the bf16/fp16
operands go to the tensor cores as they are, with fp32 accumulation. fp32 inputs use IEEE fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.lora_segments import DecodeLora, lora_expand_ref, segments_per_row, slice_starts
from kernels.utils import SHARED_BYTES, TL_DTYPE, cdiv, next_power_of_2

MAX_ROWS = 64  # the most rows one launch takes: beyond, the step is no longer a stream of W (cuBLAS's shape)
_BLOCK_R = 8  # ranks gathered per step of the LoRA loop: [BLOCK_M, 8, BLOCK_N] in registers


@triton.jit
def _decode_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # [N], unused without HAS_BIAS
    y_ptr,  # [M, N]
    t_ptr,  # [S, M, R] fp32, unused without HAS_LORA
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [slots, S, R] int64
    rank_ptr,  # [slots, S]
    scale_ptr,  # [slots] fp32
    slot_ptr,  # [M]
    slice_ptr,  # [S + 1] first column of each slice, then N
    M, N, K,
    stride_xm, stride_wn, stride_ym,
    stride_ti, stride_tm,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    b_base_offset, layer,
    NUM_SLICES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_LORA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn  # [1, BN]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < K
        wt = tl.load(w_rows + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)  # [BK, BN]
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        acc += tl.dot(xt.to(DOT_DTYPE), wt.to(DOT_DTYPE), input_precision=DOT_PRECISION)

    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_LORA:
        slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1)  # [BM]
        live = slot >= 0
        s_idx = tl.maximum(slot, 0).to(tl.int64)
        scale = tl.load(scale_ptr + s_idx, mask=m_mask, other=0.0).to(tl.float32)  # [BM]
        sl = 0
        for i in tl.static_range(1, NUM_SLICES):  # the panel's slice: it lies within one
            sl += (n0 >= tl.load(slice_ptr + i)).to(tl.int32)
        col0 = tl.load(slice_ptr + sl)
        width = tl.load(slice_ptr + sl + 1) - col0
        rank = tl.where(live, tl.load(rank_ptr + s_idx * stride_rs + sl * stride_ri, mask=m_mask, other=0), 0)  # [BM]
        t_rows = t_ptr + sl * stride_ti + offs_m[:, None] * stride_tm  # [BM, 1]
        page_rows = page_ptr + s_idx[:, None] * stride_ps + sl * stride_pi  # [BM, 1]: each row's page table of the slice
        pool_b = pool_ptr + b_base_offset + layer * width + (offs_n - col0)[None, None, :]  # [1, 1, BN] + a page start
        delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, tl.max(rank, axis=0), BLOCK_R):  # the batch's largest rank; each row stops at its own
            offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
            r_ok = offs_r[None, :] < rank[:, None]  # [BM, BR]
            tv = tl.load(t_rows + offs_r[None, :], mask=r_ok, other=0.0)  # [BM, BR] fp32
            pages = tl.load(page_rows + offs_r[None, :] * stride_pr, mask=r_ok, other=0)  # [BM, BR] int64
            bv = tl.load(pool_b + pages[:, :, None], mask=r_ok[:, :, None] & n_mask[None, None, :], other=0.0)  # [BM, BR, BN]
            delta += tl.sum(tv[:, :, None] * bv.to(tl.float32), axis=1)
        acc += scale[:, None] * delta
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def decode_linear(
    x: torch.Tensor,  # [M, K], M <= MAX_ROWS
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,  # [N]
    lora: DecodeLora | None = None,
) -> torch.Tensor:  # [M, N]
    """x W^T + bias + each row's LoRA delta, in one launch (see Semantics)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS, f"decode_linear takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1, (tuple(x.shape), tuple(weight.shape))
    assert x.dtype == weight.dtype and x.dtype in TL_DTYPE, (x.dtype, weight.dtype)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, num_warps, num_stages = _config(m, n, k, x.element_size())
    starts = slice_starts(lora.slices if lora is not None else (n,), x.device)
    pw = lora.weights if lora is not None else None
    if lora is not None:
        max_rank = pw.max_rank
        assert sum(lora.slices) == n, (lora.slices, n)
        assert lora.t.shape == (len(lora.slices), m, max_rank) and lora.t.dtype == torch.float32 and lora.t.stride(2) == 1, \
            (tuple(lora.t.shape), lora.t.dtype)  # fmt: skip
        assert lora.slot.shape == (m,) and pw.pool.dtype == x.dtype and pw.in_features == k, (tuple(lora.slot.shape), pw.pool.dtype)
        pw.check(x.device)
        offset = 0
        for w in lora.slices:  # every panel inside one slice
            assert offset % block_n == 0, f"slice boundary {offset} is not a multiple of BLOCK_N {block_n}: slices {lora.slices}"
            offset += w
    interpreted = x.device.type == "cpu"
    _decode_linear_kernel[(cdiv(n, block_n),)](
        x, weight, bias if bias is not None else x, y,
        lora.t if lora else x, pw.pool if lora else x, pw.pages if lora else x, pw.rank if lora else x, pw.scale if lora else x,
        lora.slot if lora else x, starts,
        m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        lora.t.stride(0) if lora else 0, lora.t.stride(1) if lora else 0,
        *(pw.pages.stride() if lora else (0, 0, 0)), *(pw.rank.stride() if lora else (0, 0)),
        pw.num_layers * pw.in_features if lora else 0, pw.layer if lora else 0,
        NUM_SLICES=len(lora.slices) if lora else 1,
        HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None,
        BLOCK_M=max(16, next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_R=_BLOCK_R,
        DOT_DTYPE=tl.float32 if interpreted else TL_DTYPE[x.dtype],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpreted else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return y


def _config(m: int, n: int, k: int, elem: int = 2) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages): the swept best for the shapes in `_TUNED`; otherwise the widest panel
    that still gives the grid ~128 programs (an H200 has 132 SMs). Stages are cut until the pipeline's buffers fit the
    shared memory: each stage holds a [BLOCK_K, BLOCK_N] tile of W and a [BLOCK_M, BLOCK_K] tile of x. The tuned 5
    stages, swept at 32 rows, asked 245,760 bytes at 64 rows in bf16 (over sm_90's 232,448), and the launch failed."""
    if (n, k) in _TUNED:
        block_n, block_k, num_warps, num_stages = _TUNED[(n, k)][0]
    else:
        block_n = 64
        while block_n > 16 and n // block_n < 128:
            block_n //= 2
        block_k, num_warps, num_stages = 256, 4, 4
    while num_stages > 1 and shared_bytes(m, block_n, block_k, num_stages, elem) > SHARED_BYTES:
        num_stages -= 1
    return block_n, block_k, num_warps, num_stages


def shared_bytes(m: int, block_n: int, block_k: int, num_stages: int, elem: int) -> int:
    """Shared memory of the K loop's pipeline: num_stages x (W tile + x tile), as Triton allocates it for this kernel."""
    return num_stages * block_k * (block_n + max(16, next_power_of_2(m))) * elem


# kernels.bench.roofline._sweep_decode_linear on an H200 (bf16, 32 rows, 32 adapters of rank 16; µs are CUDA-graph replays after
# an L2 flush), per (N, K): (config, use it for base-only rows, use it for rows with adapters), against cuBLAS alone and
# cuBLAS + the per-row expand. Two runs agreed that it wins at llama-8b's o (17.5-17.9 µs against 19.6-19.7 base,
# 21.5-22.2 against 25.3-25.4 with adapters) and down (41.5-41.6 / 42.9-43.2, 44.4-45.7 / 48.3). Elsewhere cuBLAS was as
# fast or faster: 8b qkv with adapters 29.2 / 30.3 in one run, 31.2 / 30.7 in the other; both gate_up (8b 69.2 at best
# against 70.3 base, 90.3 against 84.8 with adapters); all of llama-1b (qkv 11.1 / 11.0, with adapters 18.4 / 16.4: the
# delta's gather after the K loop is a tail of its own, and at 1b each GEMM is only 3-16 µs of bytes).
_TUNED: dict[tuple[int, int], tuple[tuple[int, int, int, int], bool, bool]] = {
    (4096, 4096): ((32, 256, 4, 5), True, True),
    (4096, 14336): ((32, 256, 4, 5), True, True),
}


def decode_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora: DecodeLora | None = None
) -> torch.Tensor:  # [M, N]
    """Pure torch in fp32, each row's delta at its slot's rank (the expand's reference, kernels.lora_segments), rounded
    once."""
    y = x.float() @ weight.float().t()  # [M, N] fp32
    if bias is not None:
        y += bias.float()
    if lora is not None:
        lora_expand_ref(y, lora.t, lora.weights, segments_per_row(lora.slot))
    return y.to(x.dtype)


def fits(m: int, slices: Sequence[int], k: int, lora: bool) -> bool:
    """Whether a projection of these slices and k inputs, at m rows (with adapters or not), runs here: a few rows, slice
    boundaries on panel edges, and a shape where this kernel beat cuBLAS (+ the separate expand) on an H200 (`_TUNED`)."""
    n = sum(slices)
    if not 0 < m <= MAX_ROWS or (n, k) not in _TUNED or not _TUNED[(n, k)][2 if lora else 1]:
        return False
    block_n = _config(m, n, k)[0]
    return all(w % block_n == 0 for w in slices[:-1])
