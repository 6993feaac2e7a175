"""The decode projection kernel (x W^T + bias + each row's LoRA delta, one launch) against float64.

Grid (STYLE item 7): dtype x rows (1, an odd 5, a graph bucket of 32) x adapters (none; one per row over
mixed ranks with rows of no adapter and an empty slot) x fused slices (one; qkv-like) x bias. K = 200 is a
multiple of no BLOCK_K, so every K loop ends on a masked tail; weights beyond a slot's rank are NaN and t
beyond a row's rank is NaN, so a kernel that reads past a rank fails.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(decode_linear_module,) = import_kernels("kernels.decode_linear")
decode_linear, decode_linear_ref, DecodeLora = (decode_linear_module.decode_linear, decode_linear_module.decode_linear_ref,
                                                decode_linear_module.DecodeLora)  # fmt: skip
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
K = 200
SLICES = {"one": (96,), "qkv": (64, 32, 32)}
RANKS = [8, 16, 32, 64, 1, 0]  # cycled over the slots; slot 5 is empty
SLOTS, MAX_RANK = 6, 64


def _lora(rows: int, slices: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> tuple[DecodeLora, list[int]]:
    rank = torch.tensor(RANKS, dtype=torch.int32)
    b = torch.randn(SLOTS, MAX_RANK, sum(slices), generator=gen)
    t = torch.randn(len(slices), rows, MAX_RANK, generator=gen)
    slot = [(i * 5) % SLOTS if i % 4 != 3 else -1 for i in range(rows)]  # every fourth row without an adapter
    for s, r in enumerate(RANKS):
        b[s, r:] = float("nan")
    for row, s in enumerate(slot):
        t[:, row, RANKS[s] if s >= 0 else 0 :] = float("nan")
    scale = torch.rand(SLOTS, generator=gen) + 0.5
    lora = DecodeLora(t=t.to(DEVICE), b_stack=b.to(dtype).to(DEVICE), rank=rank.to(DEVICE), scale=scale.to(DEVICE),
                      slot=torch.tensor(slot, dtype=torch.int64, device=DEVICE), slices=slices)  # fmt: skip
    return lora, slot


def _want(x, w, bias, lora: DecodeLora | None, slot: list[int]) -> torch.Tensor:
    y = x.double() @ w.double().t()
    if bias is not None:
        y += bias.double()
    if lora is not None:
        t, b = lora.t.cpu().double(), lora.b_stack.cpu().double()
        col = 0
        for s, width in enumerate(lora.slices):
            for row, sl in enumerate(slot):
                r = RANKS[sl] if sl >= 0 else 0
                if r:
                    y[row, col : col + width] += float(lora.scale[sl]) * (t[s, row, :r] @ b[sl, :r, col : col + width])
            col += width
    return y


CASES = list(itertools.product([torch.float32, torch.float16, torch.bfloat16], [1, 5, 32], ["none", "mixed"], SLICES, [False, True]))


@pytest.mark.parametrize(("dtype", "rows", "adapters", "slices", "bias"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_decode_linear_matches_float64(dtype, rows, adapters, slices, bias):
    """y equals x W^T + bias + each row's delta at its true rank within the dtype's tolerance, reading nothing past a
    rank (NaN there); rows without an adapter or with an empty slot get the base product alone."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), rows, adapters, slices, bias)).encode()))
    widths = SLICES[slices]
    x = torch.randn(rows, K, generator=gen).to(dtype)
    w = (torch.randn(sum(widths), K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(sum(widths), generator=gen).to(dtype) if bias else None
    lora, slot = _lora(rows, widths, dtype, gen) if adapters == "mixed" else (None, [])
    y = decode_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), lora)
    want = _want(x, w, b, lora, slot)
    assert y.shape == (rows, sum(widths)) and y.dtype == dtype
    assert not torch.isnan(y).any(), "NaN: a weight or t entry beyond a rank was read"
    err = (y.double().cpu() - want.cpu()).abs().max() / want.abs().max()
    assert err < TOL[dtype], f"rel err {err:.3e}"
    if lora is not None:
        ref = decode_linear_ref(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), lora)
        ref_err = (ref.double().cpu() - want.cpu()).abs().max() / want.abs().max()
        assert ref_err < TOL[dtype], f"reference rel err {ref_err:.3e}"


def test_panels_must_not_straddle_slices():
    """A slice boundary off the panel grid is refused, naming the boundary; `fits` says so beforehand, and takes the
    kernel only for the shapes (base-only, with adapters) where it was measured faster than cuBLAS."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, K, generator=gen).to(DEVICE)
    w = torch.randn(120, K, generator=gen).to(DEVICE)
    lora = DecodeLora(t=torch.zeros(2, 4, 8, device=DEVICE), b_stack=torch.zeros(2, 8, 120, device=DEVICE),
                      rank=torch.ones(2, dtype=torch.int32, device=DEVICE), scale=torch.ones(2, device=DEVICE),
                      slot=torch.zeros(4, dtype=torch.int64, device=DEVICE), slices=(100, 20))  # fmt: skip
    tuned = decode_linear_module._TUNED
    try:
        tuned[(120, K)] = tuned[(128, K)] = tuned[(96, K)] = ((16, 128, 4, 3), True, True)
        assert not decode_linear_module.fits(4, (100, 20), K, True)
        assert decode_linear_module.fits(4, (64, 32, 32), K, True)
        assert not decode_linear_module.fits(decode_linear_module.MAX_ROWS + 1, (96,), K, False)
        tuned[(96, K)] = ((16, 128, 4, 3), True, False)  # faster than cuBLAS base-only, not with the expand
        assert decode_linear_module.fits(4, (96,), K, False) and not decode_linear_module.fits(4, (96,), K, True)
    finally:
        for key in ((120, K), (128, K), (96, K)):
            tuned.pop(key, None)
    assert not decode_linear_module.fits(4, (64, 32, 32), K, True)  # an untuned shape stays with cuBLAS
    with pytest.raises(AssertionError, match="slice boundary 100"):
        decode_linear(x, w, None, lora)
