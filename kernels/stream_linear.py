"""A decode step's projection as a stream of its weight: `y = x (W * scale)^T (+ bias)` for a few rows, W in bf16/fp16 or
FP8.

Semantics: y[m, n] = scale[n] * sum_k x[m, k] W[n, k] + bias[n] for M <= 64 rows; W [N, K] in x's dtype (no scale) or
float8_e4m3fn with one fp32 scale per output row (engine.quant). Sums in fp32, y rounded once to x's dtype. Where the K
loop is split, every split's fp32 partial is added in split order, whichever split finishes last: deterministic.

Why: a decode step at batch 32 is bound by reading the weights, and at those sizes cuBLAS over bf16 streamed them at
39-77% of the byte floor on an H200 (engine/PERF.md, session 13: llama-1b qkv 10.8 µs for 2.9 µs of bytes), as did
the first FP8 kernel (kernels/fp8_linear.py's split K: 23-49%). Two things hold such a kernel back, and this one
changes both:
- Orientation. With the few rows as the dot's M, Triton cannot use Hopper's warpgroup MMA (its M is 64 a warpgroup) and
  the W tile goes through the older path. Here a program computes the transposed tile, acc[BLOCK_N, BLOCK_M] =
  W[BLOCK_N, BLOCK_K] x^T[BLOCK_K, BLOCK_M]: W's panel is the dot's M (64 or 128), the rows its N (16-64), and an FP8
  tile is widened in registers as the dot's first operand.
- Bytes in flight. A 2,048- or 4,096-wide projection in 64-column panels is 32-64 programs, a quarter to a half of the
  SMs. The K loop is split (grid (N / BLOCK_N, SPLIT_K)) until the grid covers the SMs, in ONE launch: each split
  stores its fp32 partial, then takes a ticket from its panel's counter (an atomic add, acquire-release at GPU scope);
  the split that draws the last ticket adds the partials in split order (read past L1), scales, adds the bias, stores
  y and puts the counter back to 0 for the next launch. No reduction launch, no zeroed buffer a step: what a CUDA
  graph replays is this one kernel. The counters (`_counters`) are one int32 a panel per device, shared by every
  launch: launches on a device must be stream-ordered, as the engine's are (one compute stream).

Interpreter: on CPU the dot operands are widened to fp32 (the interpreter multiplies the raw bit patterns of bf16 in
`tl.dot`, triton-lang/triton#11584); on CUDA bf16/fp16 go to the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import SHARED_BYTES, TL_DTYPE, cdiv, next_power_of_2

MAX_ROWS = 64  # beyond, a step is a GEMM of its own shape (prefill)
FP8 = torch.float8_e4m3fn
MAX_PANELS = 8192  # counters a device holds: N / BLOCK_N of the widest projection (llama-8b gate_up: 28,672 / 64 = 448)


@triton.jit
def _stream_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K] in x's dtype, or e4m3 bits (uint8) with FP8
    scale_ptr,  # [N] fp32, unused without HAS_SCALE
    bias_ptr,  # [N], unused without HAS_BIAS
    y_ptr,  # [M, N]
    part_ptr,  # [SPLIT_K, M, N] fp32 partials, unused with SPLIT_K 1
    count_ptr,  # [N / BLOCK_N] int32, 0 between launches; unused with SPLIT_K 1
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    FP8: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BN, 1]
    x_cols = x_ptr + offs_m[None, :] * stride_xm  # [1, BM]
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # y^T's tile
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < k_end
        wt = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0)  # [BN, BK]
        xt = tl.load(x_cols + offs_k[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)  # [BK, BM]
        if FP8:
            wt = wt.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(wt.to(DOT_DTYPE), xt.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    out = n_mask[:, None] & m_mask[None, :]
    offs_y = offs_m[None, :] * stride_ym + offs_n[:, None]  # [BN, BM]: y[m, n] of acc[n, m]
    if SPLIT_K > 1:
        offs_p = offs_m[None, :] * N + offs_n[:, None]  # a partial is [M, N], contiguous
        tl.store(part_ptr + split * M * N + offs_p, acc, mask=out)
        tl.debug_barrier()  # every thread's partial issued before the ticket is taken (the atomic releases them)
        ticket = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last split of this panel: add all of them, in split order
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                acc += tl.load(part_ptr + s * M * N + offs_p, mask=out, other=0.0, cache_modifier=".cg")
            _finish(acc, scale_ptr, bias_ptr, y_ptr, offs_n, offs_y, n_mask, out, HAS_SCALE, HAS_BIAS)
            tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")  # ready for the next launch
    else:
        _finish(acc, scale_ptr, bias_ptr, y_ptr, offs_n, offs_y, n_mask, out, HAS_SCALE, HAS_BIAS)


@triton.jit
def _finish(acc, scale_ptr, bias_ptr, y_ptr, offs_n, offs_y, n_mask, out, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Scale each output row's sum, add the bias, round once and store y."""
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_y, acc.to(y_ptr.dtype.element_ty), mask=out)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """The device's panel counters, zeroed once; each launch leaves them at 0 (Why)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_PANELS, dtype=torch.int32, device=device)
    return counters


def stream_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """x (weight * scale[:, None])^T + bias for at most MAX_ROWS rows, [M, N] in x's dtype (see Semantics): weight in x's
    dtype without a scale, or FP8 e4m3 with one."""
    m, k = x.shape
    n = weight.shape[0]
    fp8 = weight.dtype == FP8
    assert m <= MAX_ROWS, f"stream_linear takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape == (n, k) and weight.stride(1) == 1 and x.stride(1) == 1, (tuple(x.shape), tuple(weight.shape))
    assert x.dtype in TL_DTYPE and (fp8 or weight.dtype == x.dtype), (x.dtype, weight.dtype)
    assert (scale is not None) == fp8, "an FP8 weight takes its scale per output row, any other none"
    assert scale is None or (scale.shape == (n,) and scale.dtype == torch.float32), (None if scale is None else (scale.shape, scale.dtype))
    assert bias is None or bias.shape == (n,), tuple(bias.shape)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, num_warps, num_stages, split_k = _config(m, n, k, weight.element_size(), x.element_size())
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k  # whole K tiles per split
    split_k = cdiv(k, k_per_split)
    panels = cdiv(n, block_n)
    assert split_k == 1 or panels <= MAX_PANELS, (n, block_n)
    part = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else y
    interpreted = x.device.type == "cpu"
    _stream_kernel[(panels, split_k)](
        x, weight.view(torch.uint8) if fp8 else weight, scale if fp8 else x, bias if bias is not None else x, y,
        part, _counters(x.device) if split_k > 1 else y,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0),
        FP8=fp8,
        HAS_SCALE=fp8,
        HAS_BIAS=bias is not None,
        SPLIT_K=split_k,
        BLOCK_M=max(16, next_power_of_2(m)),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_DTYPE=tl.float32 if interpreted else TL_DTYPE[x.dtype],
        DOT_PRECISION="ieee" if x.dtype == torch.float32 or interpreted else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return y


def _config(m: int, n: int, k: int, w_elem: int, x_elem: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the swept best for the shapes in `_TUNED`; otherwise
    64-column panels, 128-deep K tiles, and the K loop split until the grid has about 4 programs an SM (an H200 has
    132). Stages are cut until the pipeline fits the shared memory."""
    key = (n, k, w_elem)
    if key in _TUNED:
        block_n, block_k, num_warps, num_stages, split_k = _TUNED[key]
    else:
        block_n, block_k, num_warps, num_stages = 64, 128, 4, 4
        split_k = max(1, min(8, 528 // cdiv(n, block_n), k // (4 * block_k)))
    while num_stages > 1 and shared_bytes(m, block_n, block_k, num_stages, w_elem, x_elem) > SHARED_BYTES:
        num_stages -= 1
    return block_n, block_k, num_warps, num_stages, split_k


# (N, K, bytes a weight element) -> config, from `python -m kernels.bench.stream` (see there). Empty until measured.
_TUNED: dict[tuple[int, int, int], tuple[int, int, int, int, int]] = {}


def shared_bytes(m: int, block_n: int, block_k: int, num_stages: int, w_elem: int, x_elem: int) -> int:
    """Shared memory of the K loop's pipeline: num_stages x (a tile of W + a tile of x)."""
    return num_stages * block_k * (block_n * w_elem + max(16, next_power_of_2(m)) * x_elem)


def stream_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                      bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """Pure torch: W widened (and scaled) in fp32, multiplied in fp32, rounded once to x's dtype."""
    w = weight.float() if scale is None else weight.float() * scale.float()[:, None]
    y = x.float() @ w.t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
