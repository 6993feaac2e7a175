"""Multi-LoRA delta for grouped rows in one launch, the shrink's K loop split: z = scale * (x A^T) B^T per row.

Semantics: as kernels/lora_delta.py's (z[i, off_s : off_s + w_s] = scale[slot_i] * (x[i] @ A[slot_i, s, :r]^T) @
B[slot_i, s, :r] with r = rank[slot_i, s]; zero where the row has no adapter or the slice rank 0; every element of z
written, none read), and the same products (t rounded to the activations' dtype once before its product with B where
the config says so).

Why another layout. kernels/lora_delta.py's programs each reduce the whole of K serially and recompute t for every
column chunk: on an H100 at llama-1b's prefill it took 74 µs at qkv where the shrink and the expand take 54, 101 at down
against 65 (engine/PERF.md, session 20). Here a program takes a tile of BLOCK_M rows of one group, one slice and one of
SPLIT_K parts of K (grid (slice x split, row tile, group); the splits of one tile are neighbours, so its x comes from
DRAM about once a slice). It stores its fp32 partial of t, then takes a ticket from the (row tile, slice)'s counter (an
atomic add, acquire-release at GPU scope, after a barrier of the program's threads). The split that draws the last
ticket adds the partials in split order (read past L1), puts the counter back to 0 and writes the slice's columns of z
for its rows, tile by tile, t @ B in registers: t is summed once and read once, no second launch, no zeroed buffer.
A slice of rank 0 (or a row group without an adapter) has its columns zeroed by its first split alone. The counters
(`_counters`) are one int32 per (row tile, slice) per device, shared by every launch: launches on a device must be
stream-ordered, as the engine's are.

Reference: kernels.lora_segments.lora_shrink_ref then lora_expand_ref(accumulate=False), the torch backend's ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraPages, LoraSegments, slice_starts
from kernels.utils import TL_DTYPE, cdiv, group_rows, next_power_of_2

MAX_RANK_TILE = 128  # the largest max rank one program holds t for (registers: BLOCK_M x RANK_TILE fp32)
MAX_COUNTERS = 1 << 18  # (row tile, slice) counters a device holds: 32 sequences of 512 tokens in 16-row tiles x 3 slices is 3,072
MAX_BYTES = 1 << 62  # no byte limit: set by the sweep where the two kernels win (kernels/lora_delta.py's notes)


@triton.jit
def _delta_split_kernel(
    x_ptr,  # [N, in]
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [slots, S, R] int64
    z_ptr,  # [N, out], written
    part_ptr,  # [SPLIT_K, N, S, RANK_TILE] fp32 partials of t, unused with SPLIT_K 1
    count_ptr,  # [G x row tiles x S] int32, 0 between launches; unused with SPLIT_K 1
    rank_ptr,  # [slots, S]
    scale_ptr,  # [slots] fp32
    slot_ptr,  # [G]
    start_ptr,  # [G + 1]
    slice_ptr,  # [S + 1] first column of each slice in z, then out
    in_features, k_per_split, stride_part,
    a_offset,  # this layer's A row inside a page: layer x in_features
    b_base_offset,  # L x in_features: where B's rows start inside a page
    layer,
    stride_xm, stride_xk,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    stride_zm, stride_zn,
    NUM_SLICES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # the shrink's: "ieee" for fp32 inputs and in the interpreter
    DOT_DTYPE: tl.constexpr,  # the shrink's tiles: their own dtype on the GPU, fp32 in the interpreter
    EXPAND_PRECISION: tl.constexpr,  # t @ B: "tf32" for fp16/bf16 on the GPU, "ieee" for fp32 and in the interpreter
    EXPAND_ROUND: tl.constexpr,  # round t to the activations' dtype once, before its product with B
    EXPAND_DTYPE: tl.constexpr,  # the product's operands: the activations' dtype where t is rounded to it (GPU), else fp32
):  # fmt: skip
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    group = tl.program_id(2)
    sl = pid_c // SPLIT_K
    split = pid_c % SPLIT_K
    slot = tl.load(slot_ptr + group)
    row_begin, row_end = group_rows(start_ptr, group, True)
    m0 = row_begin + pid_m * BLOCK_M
    if m0 >= row_end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < row_end
    z_rows = z_ptr + offs_m.to(tl.int64)[:, None] * stride_zm  # [BM, 1]
    col0 = tl.load(slice_ptr + sl)
    col_end = tl.load(slice_ptr + sl + 1)
    live = slot >= 0
    safe = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.where(live, tl.load(rank_ptr + safe * stride_rs + sl * stride_ri), 0)
    if rank == 0:  # no adapter, or the slice untargeted: the first split zeroes the slice's columns
        if split == 0:
            for n in range(col0, col_end, BLOCK_N):
                offs_n = n + tl.arange(0, BLOCK_N)
                tl.store(z_rows + offs_n[None, :] * stride_zn, tl.zeros((BLOCK_M, BLOCK_N), dtype=z_ptr.dtype.element_ty),
                         mask=m_mask[:, None] & (offs_n < col_end)[None, :])  # fmt: skip
        return
    offs_r = tl.arange(0, RANK_TILE)  # [RT]
    r_mask = offs_r < rank
    pages = tl.load(page_ptr + safe * stride_ps + sl * stride_pi + offs_r * stride_pr, mask=r_mask, other=0)  # [RT] int64
    a_rows = pool_ptr + pages + a_offset  # [RT]
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    t = tl.zeros((BLOCK_M, RANK_TILE), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < k_end
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_rows[None, :] + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, RT]
        t += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    if SPLIT_K > 1:
        p_ptrs = part_ptr + (offs_m.to(tl.int64)[:, None] * NUM_SLICES + sl) * RANK_TILE + offs_r[None, :]  # [BM, RT]
        tl.store(p_ptrs + split * stride_part, t, mask=m_mask[:, None])
        tl.debug_barrier()  # every thread's partial issued before the ticket is taken (the atomic releases them)
        counter = count_ptr + (group * tl.num_programs(1) + pid_m) * NUM_SLICES + sl
        ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if ticket != SPLIT_K - 1:
            return  # another split of this tile finishes it
        t = tl.zeros((BLOCK_M, RANK_TILE), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # in split order, whichever split drew the last ticket
            t += tl.load(p_ptrs + s * stride_part, mask=m_mask[:, None], other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    scale = tl.load(scale_ptr + safe).to(tl.float32)
    b_rows = pool_ptr + pages + b_base_offset + layer * (col_end - col0)  # [RT]: this layer's B.T row of the slice, column 0
    if EXPAND_ROUND:
        t = t.to(z_ptr.dtype.element_ty).to(EXPAND_DTYPE)
    for n in range(col0, col_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)  # [BN] column of z
        n_mask = offs_n < col_end
        bt = tl.load(b_rows[:, None] + (offs_n - col0)[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [RT, BN]
        acc = tl.dot(t, bt.to(EXPAND_DTYPE), input_precision=EXPAND_PRECISION)  # [BM, BN] fp32
        tl.store(z_rows + offs_n[None, :] * stride_zn, (scale * acc).to(z_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The device's (row tile, slice) counters, zeroed once; each launch leaves them at 0 (Why)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


def fits(weights: LoraPages, segments: LoraSegments) -> bool:
    """Whether this launch takes the batch: grouped rows (`start`), a max rank whose t a program can hold, counters for
    its row tiles, and a batch within `MAX_BYTES` of x and z."""
    if segments.start is None or next_power_of_2(weights.max_rank) > MAX_RANK_TILE:
        return False
    block_m = _config(segments, weights.in_features, len(weights.slices))[0]
    if segments.num_groups * cdiv(max(segments.max_len, 1), block_m) * len(weights.slices) > MAX_COUNTERS:
        return False
    return segments.num_rows * (weights.in_features + sum(weights.slices)) * weights.pool.element_size() <= MAX_BYTES


def lora_delta(
    x: torch.Tensor,  # [N, in]
    weights: LoraPages,  # the projection's paged adapter weights (kernels/lora_segments.py)
    segments: LoraSegments,  # the batch's row groups, with `start` (kernels/lora_segments.py)
    out_features: int,
) -> torch.Tensor:  # [N, out]
    """z = scale * (x A^T) B^T per row at each row's own rank, all slices, zeros on rows without an adapter (Semantics)."""
    w = weights
    n = x.shape[0]
    slots, num_slices, max_rank = w.pages.shape
    assert x.dim() == 2 and x.shape[1] == w.in_features, f"x {tuple(x.shape)} does not match in_features {w.in_features}"
    assert x.dtype == w.pool.dtype and x.dtype in TL_DTYPE, (x.dtype, w.pool.dtype)
    assert sum(w.slices) == out_features, f"slices {w.slices} do not split the {out_features} output columns"
    assert fits(w, segments), (segments.start is None, max_rank)
    assert segments.num_rows == n, f"segments cover {segments.num_rows} rows, x has {n}"
    w.check(x.device)
    z = torch.empty(n, out_features, dtype=x.dtype, device=x.device)
    if n == 0 or segments.num_groups == 0:
        return z
    fp32 = x.dtype == torch.float32
    block_m, block_n, block_k, split_k, num_warps, round_t = _config(segments, w.in_features, num_slices)
    round_t = round_t and not fp32
    k_per_split = cdiv(cdiv(w.in_features, split_k), block_k) * block_k  # whole K tiles per split
    split_k = cdiv(w.in_features, k_per_split)
    rank_tile = max(16, next_power_of_2(max_rank))
    part = torch.empty(split_k, n, num_slices, rank_tile, dtype=torch.float32, device=x.device) if split_k > 1 else z
    interpreted = x.device.type == "cpu"  # the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
    grid = (num_slices * split_k, cdiv(max(segments.max_len, 1), block_m), segments.num_groups)
    _delta_split_kernel[grid](
        x, w.pool, w.pages, z, part, _counters(x.device) if split_k > 1 else z, w.rank, w.scale, segments.slot,
        segments.start, slice_starts(w.slices, x.device),
        w.in_features, k_per_split, n * num_slices * rank_tile, w.a_offset(), w.num_layers * w.in_features, w.layer,
        x.stride(0), x.stride(1),
        w.pages.stride(0), w.pages.stride(1), w.pages.stride(2),
        w.rank.stride(0), w.rank.stride(1),
        z.stride(0), z.stride(1),
        NUM_SLICES=num_slices,
        SPLIT_K=split_k,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        RANK_TILE=rank_tile,
        DOT_PRECISION="ieee" if fp32 or interpreted else "tf32",
        DOT_DTYPE=tl.float32 if interpreted else TL_DTYPE[x.dtype],
        EXPAND_PRECISION="ieee" if fp32 or interpreted else "tf32",
        EXPAND_ROUND=round_t,
        EXPAND_DTYPE=TL_DTYPE[x.dtype] if round_t and not interpreted else tl.float32,
        num_warps=num_warps,
    )  # fmt: skip
    return z


_TARGET_PROGRAMS = 528  # about 4 an SM of an H100/H200 (132)
_MIN_K_PER_SPLIT = 256


def _config(segments: LoraSegments, in_features: int, num_slices: int = 1) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, round t): 64-row tiles (16 where groups are short), K split until
    the grid has about 4 programs an SM or a split would hold under 256 of K. Not yet swept."""
    block_m = 16 if segments.max_len <= 16 else 64
    tiles = max(1, segments.num_groups * cdiv(max(segments.max_len, 1), block_m) * num_slices)
    split = 1
    while tiles * split * 2 <= _TARGET_PROGRAMS and in_features // (2 * split) >= _MIN_K_PER_SPLIT:
        split *= 2
    return block_m, 128, 128, split, 4 if block_m == 16 else 8, True
