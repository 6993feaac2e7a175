"""Activations quantized to FP8 per row in one launch (kernels/fp8_quant.py) against its torch reference, the engine's
torch path (engine.quant.quantize_rows_fp8), to the bit.

Grid: dtype (bf16, fp16, fp32) x K (one tile, a masked tail, several tiles) x rows (1, an odd 7). The values span eight
decades, a row is all zeros (scale 1), one holds a single nonzero element; rows built on e4m3's ties, its largest
value and its subnormals, where a cast that truncates (Triton's interpreter's) or a scale taken by a reciprocal's
product would differ; rows holding NaN and infinities.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from engine.quant import quantize_rows_fp8
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(quant,) = import_kernels("kernels.fp8_quant")


def _rows(rows: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-4, 4, k)[torch.randperm(k, generator=g)]
    if rows > 1:
        x[1] = 0.0
        x[-1] = 0.0
        x[-1, k // 2] = -3.0
    return x.to(dtype).to(DEVICE)


def _same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == torch.float8_e4m3fn and got[1].dtype == torch.float32
    assert torch.equal(got[1], want[1]), (got[1].flatten()[:4], want[1].flatten()[:4])
    nan = got[0].float().isnan()
    assert torch.equal(nan, want[0].float().isnan())  # NaN where torch has one (its sign bit is torch's own business)
    diff = ((got[0].view(torch.uint8) != want[0].view(torch.uint8)) & ~nan).nonzero()
    assert diff.numel() == 0, [(got[0][i, j].float().item(), want[0][i, j].float().item()) for i, j in diff[:5].tolist()]


@pytest.mark.parametrize("dtype,k,rows", list(itertools.product([torch.bfloat16, torch.float16, torch.float32], [64, 1000, 4500], [1, 7])))
def test_quantize_rows_equals_the_reference_to_the_bit(dtype, k, rows):
    x = _rows(rows, k, dtype, seed=k + rows)
    _same(quant.quantize_rows(x), quantize_rows_fp8(x))


def test_ties_the_largest_value_and_subnormals_round_as_torch_casts():
    """Every e4m3 value, every midpoint between two (to the even one), values just either side of each, at scale 1 and
    at 2^-12 (subnormals), and a row of amax 449 (each value scaled by 449/448)."""
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 value >= 0
    ties = (grid[1:] + grid[:-1]) / 2  # exactly between two neighbours: to the even one
    near = torch.cat([grid * (1 + 2.0**-6), grid * (1 - 2.0**-6)])
    near = near[near <= 448.0]
    row = torch.cat([grid, ties, near, -grid, -ties])  # amax 448: scale 1, so the ties stay ties
    assert row.abs().max() == 448.0
    x = torch.stack([row, row * 2.0**-12, torch.cat([row[:-1], torch.tensor([449.0])])]).to(DEVICE)  # 2^-12: exact too
    got, want = quant.quantize_rows(x), quantize_rows_fp8(x)
    _same(got, want)
    assert got[1][0].item() == 1.0 and torch.equal(got[0][0].float()[: grid.numel()], grid.to(DEVICE))


def test_nan_and_infinity_stay_faults():
    """A NaN keeps its row's scale at 1 and stays NaN; an infinity makes the scale inf, its row zeros and itself NaN: as
    torch's ops do, so a fault upstream reaches the logits (where the engine fails the request), never finite values."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, -2.0, nan, 0.0], [1.0, -2.0, inf, 0.0], [1.0, -2.0, -inf, 0.0], [1e-40, 0.0, 0.0, 0.0]], device=DEVICE)
    got = quant.quantize_rows(x)
    _same(got, quantize_rows_fp8(x))
    assert got[1].flatten().tolist()[:3] == [1.0, inf, inf]
    assert got[0].float().isnan().nonzero().tolist() == [[0, 2], [1, 2], [2, 2]]


def test_no_rows():
    xq, scale = quant.quantize_rows(torch.zeros(0, 64, device=DEVICE))
    assert xq.shape == (0, 64) and scale.shape == (0, 1)
