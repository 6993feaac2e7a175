"""Multi-LoRA delta for grouped rows: z = scale * (x A^T) B^T per row, the shrink and the expand in one launch.

Semantics: z[i, off_s : off_s + w_s] = scale[slot_i] * (x[i] @ A[slot_i, s, :r]^T) @ B[slot_i, s, :r] with
r = rank[slot_i, s], for every slice s; zero where the row has no adapter (slot -1) or the slice has rank 0. Every
element of z is written and none is read: what kernels/lora_shrink.py followed by kernels/lora_expand.py with
`accumulate=False` compute, for the engine's delta-first prefill (engine.lora, "Prefill": the base GEMM then adds
its product into z).

Why one launch. A short prefill at llama-1b (32 x 128 tokens) waits for the host: its GPU work with adapters is
about 18 ms, its step about 24-37 ms on an H100's host (engine/PERF.md, sessions 19 and 20), and each of the two
kernels a projection costs a launch, a t buffer (zeroed where the shrink splits K) and their launchers' Python. Here
a program takes a tile of BLOCK_M rows of one group and a chunk of one slice's columns: it computes the tile's t
[BLOCK_M, RANK_TILE] over the whole of K in registers (x read once per chunk, A's rows up to the slot's rank, the
rest masked), then walks its chunk's columns in BLOCK_N steps, t @ B in fp32 (TF32 on the GPU for fp16/bf16, as the
expand) times the slot's scale, each tile of z stored once. t never goes to memory.

Chunks: a (slice, first column, end column, the slice's first column and width) table, the slice's columns cut into `chunk` wide pieces so that a wide slice
(q at llama-1b: 2048) is several programs and a narrow one (k: 512) one; a program recomputes its tile's t for each
chunk, which costs an x tile read from L2 per chunk. Grid: (chunk, row tile, group), as the shrink's.

Products as the two kernels': x and A tiles multiplied in their own dtype on the GPU (fp32 sums, exact products), and
widened to fp32 in the interpreter (triton-lang/triton#11584); t stays fp32, is rounded to TF32 for the B product, and
z is rounded once when stored: then z equals the two kernels' to the rounding of sums taken in another order. A config
may instead round t to the activations' dtype once (`round t`, as PEFT rounds its bf16 or fp16 lora_A output) and
multiply it with B on the tensor cores in that dtype; the interpreter multiplies the same rounded values in fp32. The
launcher's configs do, for fp16 and bf16 (fp32 inputs keep t in fp32): t then carries the dtype's 8 or 11 significant
bits, not TF32's 11, and an fp16 t beyond 65,504 overflows where PEFT's would too. The decode path and the torch
backend keep t in fp32.

RANK_TILE is the pages' max rank rounded up to a power of two (at least 16): one K loop for every rank of the slot. A
max rank above 128 would hold too many registers; the launcher's `fits` refuses it and the engine runs the two kernels.
`fits` also refuses a batch whose x and z exceed `MAX_BYTES`: there the GPU, not the host, sets the pace, and the two
kernels are faster on it (figures at `MAX_BYTES`).

Reference: kernels.lora_segments.lora_shrink_ref then lora_expand_ref(accumulate=False), the torch backend's ops.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.lora_segments import LoraPages, LoraSegments
from kernels.utils import TL_DTYPE, cdiv, group_rows, next_power_of_2

MAX_RANK_TILE = 128  # the largest max rank one program holds t for (registers: BLOCK_M x RANK_TILE fp32)
# The most bytes of x and z (rows x (in + out) elements) a batch may have for this launch. Each program reduces the whole of
# K serially where the shrink splits it over programs, so on the GPU the one launch is 2-4x slower than the two kernels
# (H100, 32 adapters of rank 16, kernels.bench.roofline `_sweep_prefill_fused_delta`, session 20: llama-1b at 32 x 128
# tokens qkv 111.6 µs against 54.4, o 61.5 / 37.8, down 120.7 / 64.8; llama-8b at 32 x 512, qkv 672.0 / 220.4). It pays
# where the GPU waits for the host anyway: the llama-1b prefill with adapters took 23.4 ms on the device with it against
# 25.0 with the two kernels (engine.bench.prefill_ab --swap lora_delta=off), the llama-8b one 481.7 against 421.8. The 1b
# batch's largest projection (down: 4,096 x (8,192 + 2,048) bf16) is 84 MB; the 8b one's smallest 16,384 x 8,192 x 2 B.
MAX_BYTES = 96 * 2**20


@triton.jit
def _delta_kernel(
    x_ptr,  # [N, in]
    pool_ptr,  # [E] the pages (kernels.lora_segments.LoraPages)
    page_ptr,  # [slots, S, R] int64
    z_ptr,  # [N, out], written
    rank_ptr,  # [slots, S]
    scale_ptr,  # [slots] fp32
    slot_ptr,  # [G]
    start_ptr,  # [G + 1]
    chunk_ptr,  # [C, 5] int32: slice, first column of z, end column of z, the slice's first column of z, its width
    in_features,
    a_offset,  # this layer's A row inside a page: layer x in_features
    b_base_offset,  # L x in_features: where B's rows start inside a page
    layer,
    stride_xm, stride_xk,
    stride_ps, stride_pi, stride_pr,
    stride_rs, stride_ri,
    stride_zm, stride_zn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RANK_TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # the shrink's: "ieee" for fp32 inputs and in the interpreter
    DOT_DTYPE: tl.constexpr,  # the shrink's tiles: their own dtype on the GPU, fp32 in the interpreter
    EXPAND_PRECISION: tl.constexpr,  # t @ B: "tf32" for fp16/bf16 on the GPU, "ieee" for fp32 and in the interpreter
    EXPAND_ROUND: tl.constexpr,  # round t to the activations' dtype once, before its product with B (see Products)
    EXPAND_DTYPE: tl.constexpr,  # the product's operands: the activations' dtype where t is rounded to it (GPU), else fp32
):  # fmt: skip
    pid_c = tl.program_id(0)
    pid_m = tl.program_id(1)
    group = tl.program_id(2)
    slot = tl.load(slot_ptr + group)
    row_begin, row_end = group_rows(start_ptr, group, True)
    chunk = chunk_ptr + pid_c * 5
    sl = tl.load(chunk)
    c_begin = tl.load(chunk + 1)
    c_end = tl.load(chunk + 2)
    col0 = tl.load(chunk + 3)  # the slice's first column in z
    w_s = tl.load(chunk + 4)
    m0 = row_begin + pid_m * BLOCK_M
    if m0 >= row_end:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)  # [BM]
    m_mask = offs_m < row_end
    z_rows = z_ptr + offs_m.to(tl.int64)[:, None] * stride_zm  # [BM, 1]
    live = slot >= 0
    safe = tl.maximum(slot, 0).to(tl.int64)
    rank = tl.where(live, tl.load(rank_ptr + safe * stride_rs + sl * stride_ri), 0)
    if rank == 0:  # no adapter, or the slice untargeted: the delta is zero
        for n in range(c_begin, c_end, BLOCK_N):
            offs_n = n + tl.arange(0, BLOCK_N)
            tl.store(z_rows + offs_n[None, :] * stride_zn, tl.zeros((BLOCK_M, BLOCK_N), dtype=z_ptr.dtype.element_ty),
                     mask=m_mask[:, None] & (offs_n < c_end)[None, :])  # fmt: skip
        return
    offs_r = tl.arange(0, RANK_TILE)  # [RT]
    r_mask = offs_r < rank
    pages = tl.load(page_ptr + safe * stride_ps + sl * stride_pi + offs_r * stride_pr, mask=r_mask, other=0)  # [RT] int64
    a_rows = pool_ptr + pages + a_offset  # [RT]
    t = tl.zeros((BLOCK_M, RANK_TILE), dtype=tl.float32)
    for k in range(0, in_features, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < in_features
        xt = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        at = tl.load(a_rows[None, :] + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :], other=0.0)  # [BK, RT]
        t += tl.dot(xt.to(DOT_DTYPE), at.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    scale = tl.load(scale_ptr + safe).to(tl.float32)
    b_rows = pool_ptr + pages + b_base_offset + layer * w_s  # [RT]: this layer's B.T row of the slice, column 0
    if EXPAND_ROUND:
        t = t.to(z_ptr.dtype.element_ty).to(EXPAND_DTYPE)
    for n in range(c_begin, c_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)  # [BN] column of z
        n_mask = offs_n < c_end
        bt = tl.load(b_rows[:, None] + (offs_n - col0)[None, :], mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [RT, BN]
        acc = tl.dot(t, bt.to(EXPAND_DTYPE), input_precision=EXPAND_PRECISION)  # [BM, BN] fp32
        tl.store(z_rows + offs_n[None, :] * stride_zn, (scale * acc).to(z_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


def fits(weights: LoraPages, segments: LoraSegments) -> bool:
    """Whether this launch takes the batch: grouped rows (`start`), a max rank whose t a program can hold, and a batch
    small enough that launches, not bytes, are what its LoRA costs (`MAX_BYTES`)."""
    if segments.start is None or next_power_of_2(weights.max_rank) > MAX_RANK_TILE:
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
    block_m, block_n, block_k, chunk, num_warps, round_t = _config(segments, w.in_features)
    round_t = round_t and not fp32
    table = chunks(w.slices, chunk, x.device)
    interpreted = x.device.type == "cpu"  # the interpreter multiplies bf16 bit patterns in tl.dot (triton-lang/triton#11584)
    grid = (table.shape[0], cdiv(max(segments.max_len, 1), block_m), segments.num_groups)
    _delta_kernel[grid](
        x, w.pool, w.pages, z, w.rank, w.scale, segments.slot, segments.start, table,
        w.in_features, w.a_offset(), w.num_layers * w.in_features, w.layer,
        x.stride(0), x.stride(1),
        w.pages.stride(0), w.pages.stride(1), w.pages.stride(2),
        w.rank.stride(0), w.rank.stride(1),
        z.stride(0), z.stride(1),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        RANK_TILE=max(16, next_power_of_2(max_rank)),
        DOT_PRECISION="ieee" if fp32 or interpreted else "tf32",
        DOT_DTYPE=tl.float32 if interpreted else TL_DTYPE[x.dtype],
        EXPAND_PRECISION="ieee" if fp32 or interpreted else "tf32",
        EXPAND_ROUND=round_t,
        EXPAND_DTYPE=TL_DTYPE[x.dtype] if round_t and not interpreted else tl.float32,
        num_warps=num_warps,
    )  # fmt: skip
    return z


@functools.cache
def chunks(widths: tuple[int, ...], chunk: int, device: torch.device) -> torch.Tensor:  # [C, 5] int32
    """The programs' column chunks of fused slices `widths`, at most `chunk` columns each: (slice, first column, end
    column, the slice's first column, its width) per chunk, on `device`. Made once per (slices, chunk, device)."""
    rows, col0 = [], 0
    for s, width in enumerate(widths):
        for c in range(0, width, chunk):
            rows.append((s, col0 + c, col0 + min(c + chunk, width), col0, width))
        col0 += width
    return torch.tensor(rows, dtype=torch.int32, device=device)


def _config(segments: LoraSegments, in_features: int) -> tuple[int, int, int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, chunk columns, num_warps, round t): the best of `_sweep_prefill_fused_delta`'s grid at
    llama-1b (32 x 128 tokens, 32 adapters of rank 16 in pages of max rank 64, H100, session 20) for all three
    projections, t rounded: qkv 74.1 µs against 112.5 unrounded, o 43.4 / 61.3, down 101.1 / 119.8 (the two kernels: 54.1,
    38.0, 65.3). With a max rank of 16 the engine's prefill took the same time either way (engine.bench.prefill_ab,
    20.82 ms against 20.79). 16-row tiles where groups are short."""
    if segments.max_len <= 16:
        return 16, 128, 128, 1024, 4, True
    return 64, 128, 128, 1024, 8, True
