"""Residual add and RMSNorm in one pass: `residual += x; out = rmsnorm(residual) * weight`.

Semantics, per row of `x [N, dim]`: s = x + residual, rounded to the input dtype (the running hidden state,
written back into `residual` in place); out = s * rsqrt(mean(s^2) + eps) * weight, the mean square and the
products in fp32, rounded once when stored. Without `residual`, out = rmsnorm(x) and nothing else is written.

Why one kernel: a decoder layer adds each sublayer's output to the residual stream and normalises the sum
for the next sublayer, twice per layer. As separate ops that is an add (read 2, write 1) then a norm (read 1,
write 1): two launches and five passes over [N, dim]; fused it is one launch and four passes (read x and
residual, write both). In a llama-1b decode graph (batch 32) each launch is 2-3 µs of work plus ~1 µs of
gap, against ~3 µs for the fused one, 32 times a step (vLLM's fused_add_rms_norm, the same idea in CUDA).

One program per row, the whole row in registers (dim up to 8192 at 8 warps: 32 values a thread).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.utils import next_power_of_2


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [N, dim]
    res_ptr,  # [N, dim], read and written in place when HAS_RES
    w_ptr,  # [dim]
    out_ptr,  # [N, dim]
    dim,
    eps,
    stride_x, stride_r, stride_o,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        s += tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = s.to(res_ptr.dtype.element_ty)  # the residual stream keeps the model's dtype, as the unfused add
        tl.store(res_ptr + row * stride_r + cols, s, mask=mask)
        s = s.to(tl.float32)
    inv = tl.rsqrt(tl.sum(s * s, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor,  # [N, dim]
    weight: torch.Tensor,  # [dim]
    eps: float,
    residual: torch.Tensor | None = None,  # [N, dim]: becomes x + residual, in place
) -> torch.Tensor:  # [N, dim] in x's dtype
    """rmsnorm(x + residual) * weight, with residual updated to x + residual (see Semantics)."""
    n, dim = x.shape
    assert weight.shape == (dim,) and x.stride(-1) == 1, (tuple(weight.shape), x.stride())
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1, (residual.shape, residual.dtype)
    out = torch.empty_like(x)
    if n == 0:
        return out
    block = next_power_of_2(dim)
    res = residual if residual is not None else x
    _add_rms_norm_kernel[(n,)](
        x, res, weight, out, dim, eps, x.stride(0), res.stride(0), out.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(max(block // 512, 1), 8),
    )  # fmt: skip
    return out


def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:  # [N, dim]
    """Pure torch: the add rounded to the dtype, the norm in fp32 (what the kernel computes), residual updated in place."""
    s = x if residual is None else residual.copy_(x + residual)  # [N, dim]
    sf = s.float()
    out = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)
