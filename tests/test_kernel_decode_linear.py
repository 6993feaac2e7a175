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

decode_linear_module, lora_segments = import_kernels("kernels.decode_linear", "kernels.lora_segments")
decode_linear, decode_linear_ref, DecodeLora = (decode_linear_module.decode_linear, decode_linear_module.decode_linear_ref,
                                                decode_linear_module.DecodeLora)  # fmt: skip
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
K = 200
SLICES = {"one": (96,), "qkv": (64, 32, 32)}
RANKS = [8, 16, 32, 64, 1, 0]  # cycled over the slots; slot 5 is empty
SLOTS, MAX_RANK = 6, 64


def _lora(rows: int, slices: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> tuple[DecodeLora, list[int]]:
    rank = _ranks(len(slices))
    b = torch.randn(SLOTS, MAX_RANK, sum(slices), generator=gen)
    t = torch.randn(len(slices), rows, MAX_RANK, generator=gen)
    slot = [(i * 5) % SLOTS if i % 4 != 3 else -1 for i in range(rows)]  # every fourth row without an adapter
    for row, s in enumerate(slot):
        for j in range(len(slices)):
            t[j, row, int(rank[s, j]) if s >= 0 else 0 :] = float("nan")
    scale = torch.rand(SLOTS, generator=gen) + 0.5
    # Pages shuffled, NaN behind every unused table entry: reading past a rank or into an untargeted slice fails.
    weights = lora_segments.pack_pages(torch.zeros(SLOTS, len(slices), MAX_RANK, K, dtype=dtype, device=DEVICE), b.to(dtype).to(DEVICE),
                                       rank.to(DEVICE), scale.to(DEVICE), slices, generator=torch.Generator().manual_seed(5),
                                       fill=float("nan"))  # fmt: skip
    lora = DecodeLora(t=t.to(DEVICE), weights=weights, slot=torch.tensor(slot, dtype=torch.int64, device=DEVICE))
    return lora, slot, b


def _ranks(num_slices: int) -> torch.Tensor:  # [slots, S]
    """RANKS on every slice, except that slot 2 does not target its first slice (an adapter of k and v, not q)."""
    rank = torch.tensor(RANKS, dtype=torch.int32)[:, None].repeat(1, num_slices)
    if num_slices > 1:
        rank[2, 0] = 0
    return rank


def _want(x, w, bias, lora: DecodeLora | None, slot: list[int], b_stack=None) -> torch.Tensor:
    y = x.double() @ w.double().t()
    if bias is not None:
        y += bias.double()
    if lora is not None:
        t, b = lora.t.cpu().double(), b_stack.cpu().double()
        rank = lora.weights.rank.cpu()
        col = 0
        for s, width in enumerate(lora.slices):
            for row, sl in enumerate(slot):
                r = int(rank[sl, s]) if sl >= 0 else 0
                if r:
                    y[row, col : col + width] += float(lora.weights.scale[sl]) * (t[s, row, :r] @ b[sl, :r, col : col + width])
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
    lora, slot, b_stack = _lora(rows, widths, dtype, gen) if adapters == "mixed" else (None, [], None)
    y = decode_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), lora)
    want = _want(x, w, b, lora, slot, b_stack)
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
    weights = lora_segments.pack_pages(torch.zeros(2, 2, 8, K, device=DEVICE), torch.zeros(2, 8, 120, device=DEVICE),
                                       torch.ones(2, dtype=torch.int32, device=DEVICE), torch.ones(2, device=DEVICE), (100, 20))
    lora = DecodeLora(t=torch.zeros(2, 4, 8, device=DEVICE), weights=weights, slot=torch.zeros(4, dtype=torch.int64, device=DEVICE))
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
