"""Multi-LoRA shrink: every row of a flat batch projected down to its own adapter's rank, in one launch.

Semantics: t[s, i, :r] = x[i] @ A[slot_i, s, :r]^T with r = rank[slot_i, s], for every slice s and every row i
whose slot_i >= 0, A's rows read through the slot's page table (kernels.lora_segments.LoraPages); the kernel writes
nothing else of t (the launcher zeroes t first when it splits K).

Punica's SGMV/BGMV shrink ("Punica: Multi-Tenant LoRA Serving", Chen et al., 2023, arXiv:2310.18547):
rows are grouped by adapter (kernels/lora_segments.py: runs of rows for prefill, one row per group for
decode), and one program computes a tile of one group's rows against its slot's A. The two forms share
this kernel and this launcher: a one-row group is just a segment of length 1, computed as a GEMV
(BLOCK_M = 1, CUDA cores) instead of a tensor-core tile.

Heterogeneous ranks (S-LoRA, Sheng et al., 2023, arXiv:2311.03285) without padding to the largest: the
rank axis is cut into BLOCK_R = 16 tiles, and a program whose tile starts at or beyond its slice's rank
returns before loading anything. A rank-8 adapter runs 1 of the 4 rank tiles of max rank 64 and reads its
8 rows of A; a slice the adapter does not target has rank 0 and runs none. (A fused tile, below, returns once
its rank tile is past every slice's rank, and masks the columns of a slice past its own.) Entries of t beyond a row's
rank are left as they were and never read by the expand.

Paged A (S-LoRA's unified paging): every rank row of a slice lives in a page of its own, anywhere in one
pool (kernels.lora_segments.LoraPages: the row of every layer, A's then B's), and the program gathers the
BR page starts of its rank tile from the slot's page table first, then reads each row as a contiguous run
of in_features elements, as it read a dense slot's rows. So memory holds each adapter at its own rank over
its own targets (no padding, no pages for untargeted projections), and the table is the graph's input.

Fused projections: A holds S slices (q, k, v: S = 3; gate, up: S = 2; others S = 1), all reading the
same x. The slice and rank tile are the fastest grid axis, so the S x (R / 16) programs that read the
same x tile run side by side and x comes from DRAM about once. Or, for tiles (FUSED_SLICES), one program
takes every slice of its rank tile: its A tile is S x 16 columns (column c is rank row r0 + c % 16 of slice
c // 16, padded to a power of two and masked past each slice's rank), so each x tile is loaded once for all
S. The launcher picks it where it measured faster (llama-8b's qkv prefill: 75.6 µs against 101.0, H100).

Products. The GPU multiplies fp16/bf16 tiles as they are, into fp32 sums: their 8- or 11-bit significands
make every product exact in fp32. The Triton interpreter multiplies the raw bit patterns of bf16 operands in
`tl.dot` (triton-lang/triton#11584), so there (x on the CPU) the tiles are widened to fp32 first and multiplied
in IEEE fp32, the same exact products. On the GPU the tiles used to be widened too (TF32 tensor cores); with
native tiles and 128-column K steps the 1b qkv prefill shrink takes 28.0 µs against 61.3 widened with 256-column
steps split 4 ways (engine/PERF.md, session 19; the two changes were not timed apart). fp32 inputs use IEEE fp32
everywhere.

Split-K. A decode batch is short (32 rows) and in_features long (4096 at 8b, 14336 for down_proj),
so one program per (row, slice) would leave most of the 132 SMs idle: 32 rows x 1 slice of down_proj is
32 programs each streaming 16 x 14336 x 2 B = 458 KB. The launcher splits K until about 512 programs
are live (down_proj: 16 splits of 896; 14.0 µs against 14.5 at 8 splits on an H200) and the splits add
into t with fp32 atomics, so t is zeroed first. Prefill splits less (up to 4, toward 384 programs for one
slice, 256 for several): 32 sequences of 128 tokens are 128 row tiles of 32 per slice, and at 1b o_proj's
128 programs 4 splits were the fastest, but at qkv's 384 one pass beat every split timed (28.0 µs; the best split,
2 ways over 64-row tiles, 31.6). Accumulation is fp32 throughout, and
t is fp32 so the expand reads it at full precision.

Reference: `kernels.lora_segments.lora_shrink_ref`, pure torch in this layout and this signature; it lives beside the row
groups rather than here because it is also the engine's torch backend, which runs without triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraPages, LoraSegments
from kernels.utils import BLOCK_R, TL_DTYPE, cdiv, group_rows, next_power_of_2

_TARGET_PROGRAMS = 512  # about 4 per SM on an H200 (132 SMs), enough to hide each program's load latency
_PREFILL_TARGET_PROGRAMS, _PREFILL_MAX_SPLIT = 384, 4  # prefill also pays a memset of t (1-3 MB) for a split
_MIN_K_PER_SPLIT = 512


@triton.jit
def _shrink_kernel(
    x_ptr,  # [N, in]
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [slots, S, R] int64: first element of each rank row's page
    t_ptr,  # [S, N, R] fp32
    rank_ptr,  # [slots, S]
    slot_ptr,  # [G]
    start_ptr,  # [G + 1], unused when HAS_START is False
    in_features,
    a_offset,  # this layer's A row inside a page
    k_per_split,  # multiple of BLOCK_K
    stride_xm, stride_xk,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    stride_ti, stride_tm, stride_tr,
    NUM_RTILES: tl.constexpr,
    SPLIT_K: tl.constexpr,
    HAS_START: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_DTYPE: tl.constexpr,  # the tiles' dtype in tl.dot: the input's on the GPU, fp32 in the interpreter
    NUM_SLICES: tl.constexpr,  # S, when one program computes every slice of its rank tile (FUSED_SLICES)
    FUSED_SLICES: tl.constexpr,  # tiles (BLOCK_M > 1): one x tile against all S slices' A tiles, x read once
    BLOCK_C: tl.constexpr,  # columns of a fused tile: S x BLOCK_R, to a power of two
):
    pid_c = tl.program_id(0)  # [slice x] rank tile x K split: programs sharing an x tile are neighbours
    pid_m = tl.program_id(1)  # row tile within the group
    group = tl.program_id(2)
    split = pid_c % SPLIT_K
    r_tile = (pid_c // SPLIT_K) % NUM_RTILES
    sl = pid_c // (SPLIT_K * NUM_RTILES)

    slot = tl.load(slot_ptr + group)
    row_begin, row_end = group_rows(start_ptr, group, HAS_START)  # issued beside the slot's load: the latencies overlap
    if slot < 0:
        return
    m0 = row_begin + pid_m * BLOCK_M
    if m0 >= row_end:
        return
    if BLOCK_M > 1:
        # Tiles: slice `sl`'s rank tile, or (FUSED_SLICES, whose grid has no slice axis: sl is 0) every slice's side by side.
        _shrink_tile(x_ptr, pool_ptr, page_ptr, t_ptr, rank_ptr, slot.to(tl.int64), sl, m0, row_end, r_tile * BLOCK_R,
                     split * k_per_split, tl.minimum(split * k_per_split + k_per_split, in_features), a_offset,
                     stride_xm, stride_xk, stride_ps, stride_pi, stride_pr, stride_rs, stride_ri,
                     stride_ti, stride_tm, stride_tr, SPLIT_K, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, DOT_DTYPE,
                     NUM_SLICES, BLOCK_C)  # fmt: skip
        return
    rank = tl.load(rank_ptr + slot.to(tl.int64) * stride_rs + sl * stride_ri)
    r0 = r_tile * BLOCK_R
    if r0 >= rank:
        return  # past this slice's rank, or a slice the adapter does not target (rank 0)

    offs_r = r0 + tl.arange(0, BLOCK_R)  # [BR]
    r_mask = offs_r < rank
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, in_features)
    # Each rank row of A lives in a page of its own: one gather of BR row starts, then rows read as contiguous runs.
    pages = tl.load(page_ptr + slot.to(tl.int64) * stride_ps + sl * stride_pi + offs_r * stride_pr, mask=r_mask, other=0)
    a_rows = pool_ptr + pages + a_offset  # [BR] pointers to this layer's row k of A

    # GEMV: one row against a [BR, BK] tile of A on CUDA cores; a tensor-core tile would be 15/16 padding.
    acc_v = tl.zeros((BLOCK_R,), dtype=tl.float32)
    x_row = x_ptr + m0.to(tl.int64) * stride_xm
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < k_end
        xv = tl.load(x_row + offs_k * stride_xk, mask=k_mask, other=0.0)  # [BK]
        at = tl.load(a_rows[:, None] + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # [BR, BK]
        acc_v += tl.sum(at.to(tl.float32) * xv.to(tl.float32)[None, :], axis=1)
    t_ptrs = t_ptr + sl * stride_ti + m0.to(tl.int64) * stride_tm + offs_r * stride_tr  # [BR]
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc_v, mask=r_mask)
    else:
        tl.atomic_add(t_ptrs, acc_v, mask=r_mask)


@triton.jit
def _shrink_tile(x_ptr, pool_ptr, page_ptr, t_ptr, rank_ptr, slot, sl0, m0, row_end, r0, k_begin, k_end, a_offset,
                 stride_xm, stride_xk, stride_ps, stride_pi, stride_pr, stride_rs, stride_ri,
                 stride_ti, stride_tm, stride_tr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, NUM_SLICES: tl.constexpr,
                 BLOCK_C: tl.constexpr):  # fmt: skip
    """One [BLOCK_M, BLOCK_K] x tile at a time against the A rows of rank tile r0 of NUM_SLICES slices from sl0 side by
    side: column c is rank row r0 + c % BLOCK_R of slice sl0 + c // BLOCK_R, so x comes from memory once for them all
    (one slice: BLOCK_C = BLOCK_R, the per-slice tile)."""
    offs_c = tl.arange(0, BLOCK_C)  # [BC]
    sl = sl0 + offs_c // BLOCK_R
    offs_r = r0 + offs_c % BLOCK_R
    live = offs_c < NUM_SLICES * BLOCK_R
    rank = tl.load(rank_ptr + slot * stride_rs + sl * stride_ri, mask=live, other=0)  # [BC] each column's slice rank
    if r0 >= tl.max(rank, axis=0):
        return  # past every slice's rank, or none targeted (rank 0)
    c_mask = live & (offs_r < rank)
    pages = tl.load(page_ptr + slot * stride_ps + sl * stride_pi + offs_r * stride_pr, mask=c_mask, other=0)  # [BC]
    a_rows = pool_ptr + pages + a_offset
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < row_end
    acc = tl.zeros((BLOCK_M, BLOCK_C), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < k_end
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_rows[None, :] + offs_k[:, None], mask=k_mask[:, None] & c_mask[None, :], other=0.0)  # [BK, BC]
        acc += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    t_ptrs = t_ptr + sl[None, :] * stride_ti + offs_m.to(tl.int64)[:, None] * stride_tm + offs_r[None, :] * stride_tr
    mask = m_mask[:, None] & c_mask[None, :]
    if SPLIT_K == 1:
        tl.store(t_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(t_ptrs, acc, mask=mask)


def lora_shrink(
    x: torch.Tensor,  # [N, in]
    weights: LoraPages,  # the projection's paged adapter weights (kernels/lora_segments.py)
    segments: LoraSegments,  # the batch's row groups (kernels/lora_segments.py)
    *,
    out: torch.Tensor | None = None,  # [S, N, R] fp32 to fill instead of a fresh one (a CUDA-graph buffer)
    out_zeroed: bool = False,  # `out` is all zeros already (one memset for many launches): not zeroed again
) -> torch.Tensor:  # [S, N, R] fp32
    """t = x A^T per row at each row's own rank, for all S slices in one launch (see Semantics)."""
    w = weights
    slots, num_slices, max_rank = w.pages.shape
    in_features = w.in_features
    n = x.shape[0]
    assert x.dim() == 2 and x.shape[1] == in_features, f"x {tuple(x.shape)} does not match in_features {in_features}"
    assert x.dtype == w.pool.dtype and x.dtype in (torch.float32, torch.float16, torch.bfloat16), (x.dtype, w.pool.dtype)
    w.check(x.device)
    assert segments.slot.device == x.device, (segments.slot.device, x.device)
    assert segments.num_rows == n, f"segments cover {segments.num_rows} rows, x has {n}"
    split_k, block_m, block_k, num_warps, num_stages, fused = _config(segments, num_slices, in_features)
    fused = fused and block_m > 1 and num_slices > 1
    if out is None:
        out = (torch.zeros if split_k > 1 else torch.empty)(num_slices, n, max_rank, dtype=torch.float32, device=x.device)
    else:
        assert out.shape == (num_slices, n, max_rank) and out.dtype == torch.float32, (tuple(out.shape), out.dtype)
        if split_k > 1 and not out_zeroed:
            out.zero_()  # the K splits add into it
    if n == 0 or segments.num_groups == 0:
        return out
    num_rtiles = cdiv(max_rank, BLOCK_R)
    k_per_split = cdiv(cdiv(in_features, split_k), block_k) * block_k
    grid = ((1 if fused else num_slices) * num_rtiles * split_k, cdiv(max(segments.max_len, 1), block_m), segments.num_groups)
    interpreted = x.device.type == "cpu"  # the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
    start = segments.start if segments.start is not None else segments.slot  # placeholder, never read
    _shrink_kernel[grid](
        x, w.pool, w.pages, out, w.rank, segments.slot, start,
        in_features, w.a_offset(), k_per_split,
        x.stride(0), x.stride(1),
        w.pages.stride(0), w.pages.stride(1), w.pages.stride(2),
        w.rank.stride(0), w.rank.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        NUM_RTILES=num_rtiles,
        SPLIT_K=split_k,
        HAS_START=segments.start is not None,
        BLOCK_M=block_m,
        BLOCK_R=BLOCK_R,
        BLOCK_K=block_k,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpreted else "tf32",  # tf32 is moot for fp16/bf16 tiles
        DOT_DTYPE=tl.float32 if interpreted else TL_DTYPE[x.dtype],
        NUM_SLICES=num_slices if fused else 1,  # only the fused tiles read them: one variant per S would be compiled otherwise
        FUSED_SLICES=fused,
        BLOCK_C=next_power_of_2(num_slices * BLOCK_R) if fused else BLOCK_R,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _config(segments: LoraSegments, num_slices: int, in_features: int) -> tuple[int, int, int, int, int, bool]:
    """(split_k, BLOCK_M, BLOCK_K, num_warps, num_stages, FUSED_SLICES) for this batch. Decode, from kernels.bench.roofline._sweep
    on an H200 (bf16, 32 adapters of rank 16 in max-rank-64 slots; µs are CUDA-graph replays after an L2 flush); prefill,
    from kernels.bench.roofline._sweep_prefill_shrink at issue 4's prefills on an H100 (engine/PERF.md, session 19)."""
    fused = False
    if segments.start is None:
        # Decode, one row per group: 8b qkv 12.6 µs at split 8 (split 4: 13.0, BLOCK_K 128: 12.9).
        block_m, block_k, num_warps = 1, 256, 4
        target, max_split = _TARGET_PROGRAMS, 64
    elif segments.max_len <= 16:
        block_m, block_k, num_warps = 16, 128, 4
        target, max_split = _TARGET_PROGRAMS, 64
    else:
        # Prefill (issue 4's: 32 x 128 tokens at llama-1b, 32 x 512 at 8b; engine/PERF.md, session 19, H100): 128-column K
        # steps. One slice: 32-row tiles, K split while fewer than 384 programs run (1b o 23.8 µs, down 47.9 split 4 ways;
        # 8b o 65.5, down 179.3 unsplit). Several: split only below 256 programs (short prefills); 32-row tiles at 1b (qkv 28.0, gate_up 26.3), 64-row ones at
        # 8b, where q, k and v in one program read x once (qkv 75.6 against 101.0 and more a slice a program; gate_up's
        # two slices 73.2 apart, 78.8 together). Before: 32 x 256 tiles split toward 1024 programs, 1b qkv 61.3, o 29.5,
        # gate_up 45.3, down 58.3; 8b 132.4, 96.7, 102.4, 250.9.
        block_k, num_warps = 128, 4
        if num_slices == 1:
            block_m, target, max_split = 32, _PREFILL_TARGET_PROGRAMS, _PREFILL_MAX_SPLIT
        else:
            block_m, target, max_split = (64 if in_features >= 4096 else 32), _PREFILL_TARGET_PROGRAMS * 2 // 3, _PREFILL_MAX_SPLIT
            fused = in_features >= 4096 and num_slices >= 3
    # Programs live at rank <= 16: one rank tile per (group, row tile[, slice]).
    base = max(1, segments.num_groups * cdiv(max(segments.max_len, 1), block_m) * (1 if fused else num_slices))
    split_k = 1
    while base * split_k < target and split_k < max_split and in_features // (2 * split_k) >= _MIN_K_PER_SPLIT:
        split_k *= 2
    return split_k, block_m, block_k, num_warps, 3, fused
