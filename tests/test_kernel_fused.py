"""The fused elementwise kernels (add + RMSNorm, RoPE + KV-cache write, SiLU x up) against float64 references.

Grid (STYLE item 7, for row-wise kernels): dtype x real widths (llama-1b / 8b hidden and MLP sizes, the demo
model's, and widths that are not powers of two) x rows (1, odd, more than a warp). Outputs start as fresh
allocations and every cache slot the kernel must not write is NaN, so a missed row or a stray write fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

rms_norm, rope_cache, silu_mul = import_kernels("kernels.rms_norm", "kernels.rope_cache", "kernels.silu_mul")

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
ROWS = (1, 7, 33)


def _check(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert not got.isnan().any(), f"{what}: NaN in the output (a row or column left unwritten)"
    err = (got.double() - want.double()).abs()
    scale = want.double().abs().max().clamp_min(1e-30)
    assert err.max() / scale <= tol, f"{what}: max rel err {float(err.max() / scale):.3e}, mean {float(err.mean() / scale):.3e}"


@pytest.mark.parametrize("dtype,dim,rows,with_residual", list(itertools.product(DTYPES, (128, 2048, 4096, 3000), ROWS, (True, False))))
def test_add_rms_norm_matches_float64(dtype, dim, rows, with_residual):
    """out = rmsnorm(x + residual) * w; the residual becomes x + residual rounded to the dtype, exactly as the unfused add."""
    gen = torch.Generator().manual_seed(dim * 100 + rows)
    x = torch.randn(rows, dim, generator=gen).to(dtype).to(DEVICE)
    residual = (torch.randn(rows, dim, generator=gen) * 3).to(dtype).to(DEVICE) if with_residual else None
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE)
    before = residual.clone() if residual is not None else None
    out = rms_norm.add_rms_norm(x, weight, 1e-5, residual)
    s = (x + before) if with_residual else x  # rounded to the dtype, as the model's residual stream
    if with_residual:
        # Exact on CUDA; Triton's interpreter narrows fp32 to bf16 by truncation, not to nearest: one ulp there.
        ulp = 2**-7 if DEVICE.type == "cpu" and dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(residual, s, rtol=ulp, atol=0, msg="the residual must hold x + residual, rounded to the dtype")
    sd = s.double()
    want = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
    _check(out, want, TOL[dtype], f"add_rms_norm {dtype} dim {dim} rows {rows}")
    ref = rms_norm.add_rms_norm_ref(x, weight, 1e-5, before)
    _check(out, ref, TOL[dtype], "against the torch reference")


def test_add_rms_norm_of_no_rows():
    """An empty batch is an empty result, and no launch."""
    x = torch.empty(0, 64, device=DEVICE)
    assert rms_norm.add_rms_norm(x, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)


HEADS = {"llama-1b": (32, 8, 64), "llama-8b": (32, 8, 128), "gqa3": (6, 2, 32), "mha": (4, 4, 16)}  # heads, kv heads, head_dim


@pytest.mark.parametrize("dtype,shape,rows", list(itertools.product(DTYPES, HEADS, ROWS)))
def test_rope_and_cache_matches_float64(dtype, shape, rows):
    """q comes back rotated; rotated k and raw v land in each token's cache slot and nowhere else."""
    heads, kv_heads, d = HEADS[shape]
    gen = torch.Generator().manual_seed(heads * 1000 + rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 100_000, (rows,), generator=gen).to(DEVICE)
    inv_freq = (1.0 / (500000.0 ** (torch.arange(0, d, 2).double() / d))).float().to(DEVICE)
    num_blocks, block_size = rows + 3, 4
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:rows].to(DEVICE)  # shuffled, distinct
    k_cache = torch.full((num_blocks, block_size, kv_heads, d), float("nan"), dtype=dtype, device=DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    q = rope_cache.rope_and_cache(qkv, positions, inv_freq, k_cache, v_cache, slots, heads)

    # The angle is an fp32 product, as HF's rotary embedding computes it (at position 1e5 its rounding alone moves
    # cos by ~1e-3); everything after it in float64.
    angle = (positions.float()[:, None] * inv_freq[None, :]).double()  # [N, D/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]
    split = qkv.double().view(rows, heads + 2 * kv_heads, d)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    _check(q, rot(split[:, :heads]), TOL[dtype], f"q {shape} {dtype}")
    k_flat, v_flat = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    _check(k_flat[slots], rot(split[:, heads : heads + kv_heads]), TOL[dtype], f"k {shape} {dtype}")
    assert torch.equal(v_flat[slots], qkv.view(rows, -1, d)[:, heads + kv_heads :]), "v is copied bit for bit"
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert k_flat[untouched].isnan().all() and v_flat[untouched].isnan().all(), "a slot no token owns was written"

    k_ref, v_ref = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    q_ref = rope_cache.rope_and_cache_ref(qkv, positions, inv_freq, k_ref, v_ref, slots, heads)
    _check(q, q_ref, TOL[dtype], "q against the torch reference")
    _check(k_flat[slots], k_ref.view(-1, kv_heads, d)[slots], TOL[dtype], "k against the torch reference")


@pytest.mark.parametrize("dtype,inter,rows", list(itertools.product(DTYPES, (352, 8192, 1000), ROWS)))
def test_silu_mul_matches_float64(dtype, inter, rows):
    """out = silu(gate) * up over the fused [gate | up] rows, every column written."""
    gen = torch.Generator().manual_seed(inter + rows)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(dtype).to(DEVICE)
    out = silu_mul.silu_mul(gate_up)
    g, u = gate_up.double().chunk(2, dim=-1)
    _check(out, g * torch.sigmoid(g) * u, TOL[dtype], f"silu_mul {dtype} I {inter} rows {rows}")
    _check(out, silu_mul.silu_mul_ref(gate_up), TOL[dtype], "against the torch reference")
