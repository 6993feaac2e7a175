"""Activations quantized to FP8 per row, in one launch: `xq, scale = quantize_rows(x)` before an FP8 tensor-core GEMM.

Semantics (engine.quant.quantize_rows_fp8's, to the bit; that torch function is this kernel's reference, kept in the
engine because the torch backend runs it without triton): per row m of x [M, K], amax = max_k |x[m, k]| in fp32,
scale[m] = amax / 448 (e4m3's largest finite value; 1 for a row of zeros), xq[m, k] = x[m, k] / scale[m] clamped to
±448 and rounded to the nearest e4m3 (ties to even). A NaN stays NaN, as in torch: a row holding one gets scale 1
(NaN > 0 is false) and a NaN where it was; a row holding an infinity gets scale inf, zeros and a NaN where it was. So
a fault upstream still reaches the logits as NaN, where the engine fails the request, not as finite numbers. Both divisions are IEEE (`div_rn`; the references divide tensor by
tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which differs in the last bit).

Rounding: the kernel rounds to e4m3's grid itself, in fp32 (adding and taking away a number whose last bit is the grid
step at the value's binade, step 2^-9 below 2^-6), and casts the exact result. The cast alone would round the same way
on a GPU, but Triton's CPU interpreter truncates it (84 became 88, 126.8 became 64), and the interpreter is where CI
tests this kernel.

Why: the torch ops of the reference read the activations four times and write fp32 copies between them; at a llama-8b
prefill of 16,384 tokens that is several times the bytes of the FP8 GEMM it feeds (`python -m kernels.bench.fp8`).
Here each program reads its row twice (the second read from L2) and writes one byte an element.

Grid: one program per row, the row walked in BLOCK_K tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import next_power_of_2

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr):
    # q_ptr: the e4m3 bits, as uint8
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x), propagate_nan=tl.PropagateNan.ALL)
    top = tl.max(amax, axis=0)  # a reduction drops NaNs: put one back where the row held one
    top = tl.where(tl.max((amax != amax).to(tl.int32), axis=0) > 0, float("nan"), top)
    scale = tl.where(top > 0, tl.math.div_rn(top, FP8_MAX), 1.0)
    tl.store(s_ptr + row, scale)
    for k in range(0, K, BLOCK_K):
        offs = k + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX, propagate_nan=tl.PropagateNan.ALL), FP8_MAX,
                       propagate_nan=tl.PropagateNan.ALL)
        r = _round_e4m3(q)
        bits = r.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        tl.store(q_row + offs, tl.where(r != r, 0x7F, bits).to(tl.uint8), mask=offs < K)  # NaN as e4m3's 0x7F: the interpreter's cast loses it


@triton.jit
def _round_e4m3(v):
    """v (fp32, |v| <= 448) rounded to the nearest e4m3 value, ties to even (module docstring, Rounding)."""
    a = tl.abs(v)
    binade = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # e4m3's subnormals share the step of 2^-6
    magic = (((binade + 147) << 23) | 0x400000).to(tl.float32, bitcast=True)  # 1.5 x 2^(binade + 20): last bit 2^(binade - 3)
    r = (a + magic) - magic
    sign = v.to(tl.int32, bitcast=True) & -2147483648  # v's sign bit: -0.0 and what rounds to zero keep theirs
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K] float8_e4m3fn, scale [M, 1] fp32) of x [M, K] (see Semantics)."""
    assert x.dim() == 2 and x.stride(1) == 1, (tuple(x.shape), x.stride())
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block_k = min(2048, next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q.view(torch.uint8), scale, k, x.stride(0), q.stride(0), BLOCK_K=block_k, FP8_MAX=FP8_MAX,
                                    num_warps=4 if block_k <= 1024 else 8)  # fmt: skip
    return q, scale
