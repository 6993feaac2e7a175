"""Multi-LoRA expand: every row's rank-r vector projected back up by its own adapter and added, in one launch.

Semantics: y[i, off_s : off_s + w_s] += scale[slot_i] * t[s, i, :r] @ B[slot_i, s, :r]
with r = rank[slot_i, s], for every slice s and every row i whose slot_i >= 0, B's rows read through the slot's
page table (kernels.lora_segments.LoraPages); rows with slot -1, and slices of rank 0 (empty, or not targeted by
the row's adapter), are not written at all (bit for bit as they were). With `accumulate=False` the
kernel writes the delta instead of adding it (`=` for `+=`), and zeros in the rows without an adapter:
every element of y is written and none is read.

Why the second form: in a long prefill the expand is bound by its bytes, and adding into y reads and
writes all of y (8b gate_up, 16,384 tokens: 1.9 GB a layer). Writing the delta z alone halves that, and
the base GEMM then adds its product into z in its epilogue (`z.addmm_(x, W^T)`, beta = 1): that GEMM is
bound by its FLOPs, so reading z there hides under the tensor cores' time (engine.lora, "Prefill").

Punica's SGMV/BGMV expand ("Punica: Multi-Tenant LoRA Serving", Chen et al., 2023, arXiv:2310.18547),
the second half of `y += s * (x A^T) B^T` after kernels/lora_shrink.py. Rows are grouped as for the
shrink (kernels/lora_segments.py); one program adds one (row tile, column tile) of one slice, looping
over its slot's rank in BLOCK_R = 16 steps up to rank[slot] and no further (mixed ranks at their true
cost, S-LoRA, Sheng et al., 2023, arXiv:2311.03285). A one-row group runs as a GEMV on CUDA cores
(BLOCK_M = 1), a longer one as tensor-core tiles; same kernel, same launcher.

Layout of B, and why it differs from PEFT's `lora_B [out, r]`: rank-major, `lora_B.T [r, w_s]`, each rank row
of a slice in a page of its own (kernels.lora_segments.LoraPages), found through the slot's page table. Row k of
a slice is then w_s contiguous elements, so stopping at rank r reads exactly r * w_s elements, and one gather of
BR page starts per rank step is all the indirection costs. In an `[out, R]` layout a rank-8 adapter would read
16 B out of every 128 B row of a max-rank-64 buffer: half of each 32 B sector wasted. One launch covers q, k and
v of different widths (2048, 512, 512 at llama-1b) through a table of slice offsets into y, with no pointer
arrays; a slice the row's adapter does not target has rank 0 and its programs write nothing.

Grid: (slice x column tile, row tile, group). Column tiles past a narrow slice's width return at once
(at 1b with BLOCK_N 512, k and v have 1 live tile of 4); that waste is a few empty programs. The y tile
is loaded before the rank loop, so its DRAM latency overlaps the loads of t and B. On an H200 that makes
decode a little faster (8b o_proj 8.4 µs against 9.6, with BLOCK_N 512 against 256) and 128 x 128 prefill
tiles slower (8b gate_up 573 µs against 413: the held tile costs registers), hence 64 x 256 tiles (393 µs).

Products: B tiles are widened to fp32 and multiplied with t (fp32) on TF32 tensor cores for fp16/bf16
(B exact, t rounded to TF32's 11-bit significand: finer than rounding it to bf16), IEEE fp32 for fp32
inputs; sums and the scale are fp32 and y is rounded once when stored. The op is memory-bound, and the
same code runs in the Triton interpreter, which cannot multiply bf16 in `tl.dot` (triton-lang/triton#11584).

Reference: `kernels.lora_segments.lora_expand_ref`, pure torch in this layout and this signature; it lives beside the row
groups rather than here because it is also the engine's torch backend, which runs without triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraPages, LoraSegments, slice_starts
from kernels.utils import BLOCK_R, cdiv, group_rows


@triton.jit
def _tile_delta(t_base, pool_b, page_base, offs_m, m_mask, offs_n, n_mask, rank, stride_tm, stride_tr, stride_pr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """t[rows, :rank] @ B[:rank, cols] for one tile, in BLOCK_R steps up to the rank and no further: [BM, BN] fp32. B's
    row k is at pool_b + page_base[k] (the slot's page table for this slice; pool_b: pool + this layer's B offset)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
        r_mask = offs_r < rank
        tt = tl.load(
            t_base + offs_m.to(tl.int64)[:, None] * stride_tm + offs_r[None, :] * stride_tr,
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BM, BR] fp32
        pages = tl.load(page_base + offs_r * stride_pr, mask=r_mask, other=0)  # [BR] int64
        bt = tl.load(pool_b + pages[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BR, BN]
        acc += tl.dot(tt, bt.to(tl.float32), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _expand_kernel(
    t_ptr,  # [S, N, R] fp32
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [slots, S, R] int64
    y_ptr,  # [N, out]
    rank_ptr,  # [slots, S]
    scale_ptr,  # [slots] fp32
    slot_ptr,  # [G]
    start_ptr,  # [G + 1], unused when HAS_START is False
    slice_ptr,  # [S + 1] first column of each slice, then out
    num_ntiles,
    max_rank,  # R: rank rows of each slot in t and the page table
    b_base_offset,  # L x in_features: where B's rows start inside a page
    layer,
    stride_ti, stride_tm, stride_tr,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    stride_ym, stride_yn,
    HAS_START: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ROW_TILES: tl.constexpr,  # row tiles per program (BLOCK_M > 1): more bytes in flight per program
    ACCUMULATE: tl.constexpr,  # y += delta on adapter rows; False: y = delta, and 0 on the other rows
):
    pid_n = tl.program_id(0)  # slice x column tile
    pid_m = tl.program_id(1)  # ROW_TILES row tiles within the group
    group = tl.program_id(2)
    sl = pid_n // num_ntiles
    n0 = (pid_n % num_ntiles) * BLOCK_N

    # Loads that need nothing loaded before them go first, so their latencies overlap: a decode program is
    # a chain of a few dependent DRAM round trips (slot -> rank -> B -> y) with little data behind each.
    slot = tl.load(slot_ptr + group)
    col_begin = tl.load(slice_ptr + sl)
    width = tl.load(slice_ptr + sl + 1) - col_begin
    row_begin, row_end = group_rows(start_ptr, group, HAS_START)
    if ACCUMULATE:
        if slot < 0:
            return
    if n0 >= width:
        return
    m0 = row_begin + pid_m * (BLOCK_M * ROW_TILES)
    if m0 >= row_end:
        return
    live = slot >= 0
    safe = tl.maximum(slot, 0).to(tl.int64)  # a real slot even for rows without one
    rank = tl.where(live, tl.load(rank_ptr + safe * stride_rs + sl * stride_ri), 0)  # no adapter: rank 0, zeros
    scale = tl.load(scale_ptr + safe).to(tl.float32)
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN] column within the slice
    n_mask = offs_n < width
    cols = col_begin + offs_n  # [BN] column of y
    page_base = page_ptr + safe * stride_ps + sl * stride_pi  # the slot's page table of this slice
    pool_b = pool_ptr + b_base_offset + layer * width  # + a page's start: this layer's B row of the slice
    t_base = t_ptr + sl * stride_ti

    if BLOCK_M == 1:
        y_ptrs = y_ptr + m0.to(tl.int64) * stride_ym + cols * stride_yn  # [BN]
        if ACCUMULATE:
            yv = tl.load(y_ptrs, mask=n_mask, other=0.0)  # issued now, used after the rank loop
        # The first rank step's loads go out beside the rank's own load: bounded by the slot's stored rows, and zeroed past
        # the rank once it arrives (t and B may hold anything there). One dependent round trip fewer before the store: on an
        # H200 each decode expand is 0.1-0.8 µs faster for it. The prefill tiles' dot is slower in this form (8b gate_up
        # delta 829 µs against 491; engine/PERF.md, "Tried and set aside"), so _tile_delta waits for the rank.
        t_row = t_base + m0.to(tl.int64) * stride_tm
        offs_r = tl.arange(0, BLOCK_R)  # [BR]
        stored = offs_r < max_rank
        tv = tl.load(t_row + offs_r * stride_tr, mask=stored, other=0.0)  # [BR] fp32
        pages = tl.load(page_base + offs_r * stride_pr, mask=stored, other=0)  # [BR] int64, inside the pool past the rank too
        bt = tl.load(pool_b + pages[:, None] + offs_n[None, :], mask=stored[:, None] & n_mask[None, :], other=0.0)  # [BR, BN]
        if ACCUMULATE:
            if rank == 0:
                return  # an empty slot writes nothing: y + 0.0 would still turn -0.0 into +0.0
        r_mask = offs_r < rank
        acc_v = tl.sum(tl.where(r_mask, tv, 0.0)[:, None] * tl.where(r_mask[:, None], bt.to(tl.float32), 0.0), axis=0)
        for r0 in range(BLOCK_R, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
            r_mask = offs_r < rank
            tv = tl.load(t_row + offs_r * stride_tr, mask=r_mask, other=0.0)  # [BR] fp32
            pages = tl.load(page_base + offs_r * stride_pr, mask=r_mask, other=0)  # [BR] int64
            bt = tl.load(pool_b + pages[:, None] + offs_n[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BR, BN]
            acc_v += tl.sum(tv[:, None] * bt.to(tl.float32), axis=0)
        if ACCUMULATE:
            tl.store(y_ptrs, (yv.to(tl.float32) + scale * acc_v).to(yv.dtype), mask=n_mask)
        else:
            tl.store(y_ptrs, (scale * acc_v).to(y_ptr.dtype.element_ty), mask=n_mask)
    elif not ACCUMULATE:
        # The delta alone: nothing of y is read, so a program walks its ROW_TILES tiles in a loop (not unrolled: no
        # load waits on a store, and the registers stay those of one tile).
        for mi in range(ROW_TILES):
            offs_m = m0 + mi * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            m_mask = offs_m < row_end
            acc = _tile_delta(t_base, pool_b, page_base, offs_m, m_mask, offs_n, n_mask, rank, stride_tm, stride_tr, stride_pr,
                              BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)  # [BM, BN] fp32, before the scale
            y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn  # [BM, BN]
            tl.store(y_ptrs, (scale * acc).to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])
    else:
        if rank == 0:
            return  # an empty slot writes nothing: y + 0.0 would still turn -0.0 into +0.0
        for mi in tl.static_range(ROW_TILES):  # unrolled: the tiles' y loads can be in flight together
            offs_m = m0 + mi * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
            m_mask = offs_m < row_end
            y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn  # [BM, BN]
            mask = m_mask[:, None] & n_mask[None, :]
            yt = tl.load(y_ptrs, mask=mask, other=0.0)
            acc = _tile_delta(t_base, pool_b, page_base, offs_m, m_mask, offs_n, n_mask, rank, stride_tm, stride_tr, stride_pr,
                              BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION)  # [BM, BN] fp32, before the scale
            tl.store(y_ptrs, (yt.to(tl.float32) + scale * acc).to(yt.dtype), mask=mask)


def lora_expand(
    y: torch.Tensor,  # [N, out], updated in place
    t: torch.Tensor,  # [S, N, R] fp32, from lora_shrink
    weights: LoraPages,  # the projection's paged adapter weights (kernels/lora_segments.py); its slices split out
    segments: LoraSegments,  # the batch's row groups (kernels/lora_segments.py), as given to lora_shrink
    *,
    accumulate: bool = True,  # False: y = the delta, zeros on rows without an adapter; y is written, never read
) -> None:
    """y += scale * t B^T per row at each row's own rank, for all S slices in one launch (see Semantics)."""
    w = weights
    n, out_features = y.shape
    slots, num_slices, max_rank = w.pages.shape
    widths = w.slices
    assert sum(widths) == out_features, f"slices {widths} do not split y's {out_features} columns"
    assert t.shape == (num_slices, n, max_rank) and t.dtype == torch.float32, (tuple(t.shape), t.dtype, (num_slices, n, max_rank))
    assert y.dtype == w.pool.dtype and y.dtype in (torch.float32, torch.float16, torch.bfloat16), (y.dtype, w.pool.dtype)
    w.check(y.device)
    assert y.device == t.device == segments.slot.device, (y.device, t.device, segments.slot.device)
    assert segments.num_rows == n, f"segments cover {segments.num_rows} rows, y has {n}"
    if n == 0 or segments.num_groups == 0:
        return
    block_m, block_n, num_warps, row_tiles = _config(segments, accumulate)
    num_ntiles = cdiv(max(widths), block_n)
    grid = (num_slices * num_ntiles, cdiv(max(segments.max_len, 1), block_m * row_tiles), segments.num_groups)
    start = segments.start if segments.start is not None else segments.slot  # placeholder, never read
    _expand_kernel[grid](
        t, w.pool, w.pages, y, w.rank, w.scale, segments.slot, start, slice_starts(widths, y.device),
        num_ntiles,
        max_rank,
        w.num_layers * w.in_features,
        w.layer,
        t.stride(0), t.stride(1), t.stride(2),
        w.pages.stride(0), w.pages.stride(1), w.pages.stride(2),
        w.rank.stride(0), w.rank.stride(1),
        y.stride(0), y.stride(1),
        HAS_START=segments.start is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=BLOCK_R,
        DOT_PRECISION="ieee" if y.dtype == torch.float32 else "tf32",  # B exact, t to 11 bits
        ROW_TILES=row_tiles,
        ACCUMULATE=accumulate,
        num_warps=num_warps,
    )


def _config(segments: LoraSegments, accumulate: bool = True) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, ROW_TILES) for this batch, from kernels.bench.roofline._sweep on an H200 (bf16, rank 16;
    µs are CUDA-graph replays after an L2 flush)."""
    if segments.start is None:
        return 1, 512, 4, 1  # 8b gate_up decode 21.2 µs (BLOCK_N 256: 20.9, 1024: 21.6)
    if segments.max_len <= 16:
        return 16, 256, 4, 1
    if not accumulate:
        # The prefill delta, kernels.bench.roofline._sweep_prefill_delta: on an H200 (8b, 32 x 512 tokens, rank 16) 64 x 256
        # tiles, one per program, were the fastest for all four projections (gate_up 490 µs; 32 x 128 x 4 row tiles: 755).
        # On an H100 (engine/PERF.md, session 19), where groups are long (a prefill's sequences, 64 rows or more on
        # average), 128 x 256 tiles at 8 warps were the fastest for all four at both shapes: 8b qkv 146.7 µs against 161.9,
        # o 96.7 / 108.0, gate_up 590.9 / 631.4, down 95.4 / 107.4; 1b (32 x 128 tokens) 25.6 / 30.0, 18.0 / 21.2,
        # 101.4 / 121.2, 18.4 / 21.3. Steps of many short groups (decode rows beside a prompt) keep the smaller tiles.
        if segments.num_rows >= 64 * max(1, segments.num_groups):
            return 128, 256, 8, 1
        return 64, 256, 4, 1
    # Prefill, kernels.bench.roofline._sweep_prefill on an H200 (32 x 512 tokens, rank 16): 32 x 128 tiles at 4 warps were
    # the fastest for every projection of llama-1b and -8b (8b gate_up 1139 µs; 64 x 256 at 8 warps: 1491).
    return 32, 128, 4, 1
