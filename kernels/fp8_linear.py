"""A decode step's projection over FP8 weights: `y = x (q * scale)^T (+ bias)` for a few rows, reading q's bytes.

Semantics: y[m, n] = scale[n] * sum_k x[m, k] q[n, k] + bias[n], for M <= 64 rows, q [N, K] float8_e4m3fn with one
fp32 scale per output row (engine.quant). The scale factors out of the sum, so it is applied once, after the K loop.
Sums in fp32, y rounded once to x's dtype. Where the K loop is split (SPLIT_K > 1), each split writes its fp32 partial
and a second launch adds them in split order, scales, adds the bias and rounds: deterministic, no atomics.

Why: a decode step is bound by reading the weights, and e4m3 weights are half the bytes of bf16. Dequantizing to bf16
first (engine.quant's fallback) reads the FP8 bytes, writes and reads twice as many again: slower than bf16 alone.
Here each program streams a [BLOCK_N, K] panel of q (one byte an element) against all M rows, as kernels/
decode_linear.py does with bf16 (whose notes on grid and pipeline apply); each loaded tile is widened to x's dtype in
registers for the dot. The LoRA delta stays the separate expand's (engine.lora `apply`), as over a bf16 base outside
decode_linear's tuned shapes.

Grid: (N / BLOCK_N, SPLIT_K). A 4096-wide projection in 64-column panels is 64 programs, half the H200's SMs, each
streaming 4-14 MB of K: too few bytes in flight. Splitting K 4-8 ways gave the llama-8b projections 17-33% (`_TUNED`).
Still 23-49% of the byte floor at llama-8b: a launch of a few µs of bytes pays its ramp and tail (cuBLAS over bf16 is at
39-77% of its own floor on the same bench).

Interpreter: on CPU the dot operands are widened to fp32 (the interpreter multiplies the raw bit patterns of bf16 in
`tl.dot`, triton-lang/triton#11584); on CUDA bf16/fp16 go to the tensor cores with fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import SHARED_BYTES, TL_DTYPE, cdiv, next_power_of_2

MAX_ROWS = 64  # beyond, a step is a GEMM of its own shape (prefill): the caller dequantizes or uses tensor-core FP8
FP8 = torch.float8_e4m3fn


@triton.jit
def _fp8_linear_kernel(
    x_ptr,  # [M, K]
    q_ptr,  # [N, K] e4m3 bits (uint8)
    scale_ptr,  # [N] fp32
    bias_ptr,  # [N], unused without HAS_BIAS
    y_ptr,  # [M, N] without SPLIT_K > 1, else the fp32 partials [SPLIT_K, M, N]
    M, N, K, k_per_split,
    stride_xm, stride_qn, stride_ym, stride_ys,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)  # [BM]
    offs_n = n0 + tl.arange(0, BLOCK_N)  # [BN]
    m_mask = offs_m < M
    n_mask = offs_n < N
    q_rows = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn  # [1, BN]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [BM, 1]
    k_begin = split * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)  # [BK]
        k_mask = offs_k < k_end
        qt = tl.load(q_rows + offs_k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [BK, BN] e4m3 bits
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BM, BK]
        wt = qt.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(xt.to(DOT_DTYPE), wt.to(DOT_DTYPE), input_precision=DOT_PRECISION)
    out = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out)
    else:  # the partial sum of this split's K range; _reduce_kernel adds the splits, scales and rounds
        tl.store(y_ptr + split * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :], acc, mask=out)


@triton.jit
def _reduce_kernel(part_ptr, scale_ptr, bias_ptr, y_ptr, M, N, stride_ps, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK: tl.constexpr):  # fmt: skip
    """y = (sum of the SPLIT_K partials, in split order) * scale[n] (+ bias[n]), rounded once; flat over [M, N]."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    n = offs % N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    acc *= tl.load(scale_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (q * scale[:, None])^T + bias for at most MAX_ROWS rows (see Semantics); [M, N] in x's dtype. One launch, or
    two where the K loop is split (`_config`)."""
    m, k = x.shape
    n = q.shape[0]
    assert m <= MAX_ROWS, f"fp8_linear takes at most {MAX_ROWS} rows, got {m}"
    assert q.shape == (n, k) and q.dtype == FP8 and q.stride(1) == 1 and x.stride(1) == 1, (tuple(x.shape), tuple(q.shape), q.dtype)
    assert scale.shape == (n,) and scale.dtype == torch.float32, (tuple(scale.shape), scale.dtype)
    assert x.dtype in TL_DTYPE and (bias is None or bias.shape == (n,)), (x.dtype, None if bias is None else tuple(bias.shape))
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n, block_k, num_warps, num_stages, split_k = _config(m, n, k, x.element_size())
    k_per_split = cdiv(cdiv(k, split_k), block_k) * block_k  # whole K tiles per split
    split_k = cdiv(k, k_per_split)
    out = y if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    interpreted = x.device.type == "cpu"
    _fp8_linear_kernel[(cdiv(n, block_n), split_k)](
        x, q.view(torch.uint8), scale, bias if bias is not None else scale, out,
        m, n, k, k_per_split,
        x.stride(0), q.stride(0), out.stride(-2), out.stride(0) if split_k > 1 else 0,
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
    if split_k > 1:
        _reduce_kernel[(cdiv(m * n, _REDUCE_BLOCK),)](out, scale, bias if bias is not None else scale, y, m, n, out.stride(0),
                                                               HAS_BIAS=bias is not None, SPLIT_K=split_k, BLOCK=_REDUCE_BLOCK)  # fmt: skip
    return y


_REDUCE_BLOCK = 1024


def _config(m: int, n: int, k: int, elem: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages, SPLIT_K): the swept best for the shapes in `_TUNED`; otherwise panels
    of 64 columns and the K loop split until the grid has about 4 programs an SM (an H200 has 132). Stages are cut
    until the pipeline fits the shared memory."""
    if (n, k) in _TUNED:
        block_n, block_k, num_warps, num_stages, split_k = _TUNED[(n, k)]
    else:  # what most tuned shapes took: wide panels, short K tiles, the K loop split to about 4 programs an SM
        block_n, block_k, num_warps, num_stages = 64, 128, 4, 3
        split_k = max(1, min(8, 528 // cdiv(n, block_n), k // (4 * block_k)))
    while num_stages > 1 and shared_bytes(m, block_n, block_k, num_stages, elem) > SHARED_BYTES:
        num_stages -= 1
    return block_n, block_k, num_warps, num_stages, split_k


# `python -m kernels.bench.fp8` on an H200 (bf16 x, 32 rows; CUDA-graph replays after an L2 flush), per (N, K) of llama-8b
# and -1b: the best of 48 configs (BLOCK_N 16/32/64 x BLOCK_K 128/256 x stages 3/4 x split K 1/2/4/8), in µs against the
# untuned default's then (split K as `_config` derives it) and cuBLAS over the bf16 weight. 8b: qkv 20.5 (27.0; cuBLAS
# 23.4), o 17.0 (22.0; 19.9), gate_up 56.4 (85.5; 71.4), down 33.9 (50.6; 43.7); 1b: qkv 12.8 (13.8; 10.8), o 10.9 (12.3;
# 10.4), gate_up 21.7 (31.3; 27.5), down 17.2 (21.8; 20.1). The byte floors are 5.9, 4.0, 27.7, 13.8 and 1.5, 1.0, 7.9, 4.0.
_TUNED: dict[tuple[int, int], tuple[int, int, int, int, int]] = {
    (6144, 4096): (64, 128, 4, 3, 4),
    (4096, 4096): (64, 128, 4, 4, 4),
    (28672, 4096): (64, 128, 4, 3, 2),
    (4096, 14336): (64, 128, 4, 3, 8),
    (3072, 2048): (64, 128, 4, 3, 8),
    (2048, 2048): (16, 256, 4, 4, 1),
    (16384, 2048): (64, 128, 4, 4, 1),
    (2048, 8192): (64, 128, 4, 3, 8),
}


def shared_bytes(m: int, block_n: int, block_k: int, num_stages: int, elem: int) -> int:
    """Shared memory of the K loop's pipeline: num_stages x (an FP8 tile of q + a tile of x)."""
    return num_stages * block_k * (block_n + max(16, next_power_of_2(m)) * elem)


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: dequantize in fp32, multiply in fp32, round once to x's dtype."""
    y = x.float() @ (q.float() * scale.float()[:, None]).t()
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)
