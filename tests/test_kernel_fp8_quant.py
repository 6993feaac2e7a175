"""Activations quantized to FP8 per row in one launch (kernels/fp8_quant.py) against its torch reference, to the bit,
and the reference against the engine's torch path (engine.quant.quantize_rows_fp8).

Grid: dtype (bf16, fp16, fp32) x K (one tile, a masked tail, several tiles) x rows (1, an odd 7). The values span eight
decades, a row is all zeros (scale 1), one holds a single nonzero element, and one is built on e4m3's ties, its
largest value and its subnormals, where a cast that truncates (Triton's interpreter's) or a scale taken by a
reciprocal's product would differ.
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
    diff = (got[0].view(torch.uint8) != want[0].view(torch.uint8)).nonzero()
    assert diff.numel() == 0, [(got[0][i, j].float().item(), want[0][i, j].float().item()) for i, j in diff[:5].tolist()]


@pytest.mark.parametrize("dtype,k,rows", list(itertools.product([torch.bfloat16, torch.float16, torch.float32], [64, 1000, 4500], [1, 7])))
def test_quantize_rows_equals_the_reference_to_the_bit(dtype, k, rows):
    x = _rows(rows, k, dtype, seed=k + rows)
    _same(quant.quantize_rows(x), quant.quantize_rows_ref(x))


def test_ties_the_largest_value_and_subnormals_round_as_torch_casts():
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # every finite e4m3 value >= 0
    ties = (grid[1:] + grid[:-1]) / 2  # exactly between two neighbours: to the even one
    near = torch.cat([grid * (1 + 2.0**-6), grid * (1 - 2.0**-6)])
    row = torch.cat([grid, ties, near, -grid, -ties, torch.tensor([448.0, 449.0])])  # amax 449: every value scaled by 449/448
    x = torch.stack([row, row * 2.0**-12, row[: row.numel()] * 0 + 1.0]).to(DEVICE)
    _same(quant.quantize_rows(x), quant.quantize_rows_ref(x))
    exact = torch.cat([grid, -grid]).to(DEVICE)[None, :] * (448.0 / grid.max())  # amax 448: scale 1, every value on the grid
    _same(quant.quantize_rows(exact), quant.quantize_rows_ref(exact))


def test_the_reference_is_the_engines_torch_path():
    x = _rows(7, 1000, torch.bfloat16, seed=5).cpu()
    _same(quant.quantize_rows_ref(x), quantize_rows_fp8(x))


def test_no_rows():
    xq, scale = quant.quantize_rows(torch.zeros(0, 64, device=DEVICE))
    assert xq.shape == (0, 64) and scale.shape == (0, 1)
