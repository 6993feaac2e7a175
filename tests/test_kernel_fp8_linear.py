"""The FP8 decode projection kernel (x (q * scale)^T + bias, reading the FP8 bytes) against float64 of the dequantized
weight, and against its torch reference.

Grid (STYLE item 7): dtype x rows (1, an odd 5, a graph bucket of 32, the most: 64) x bias x N (one panel width that
divides it, one that leaves a masked tail). K = 200 is a multiple of no BLOCK_K, so every K loop ends on a masked tail;
the scales span five decades, so a kernel that applies a wrong row's scale fails.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(fp8_module,) = import_kernels("kernels.fp8_linear")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
K = 200


def _case(rows: int, n: int, dtype: torch.dtype, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, K, generator=g) * torch.logspace(-2, 3, n)[torch.randperm(n, generator=g)][:, None]
    amax = w.abs().amax(dim=1)
    scale = amax / 448.0
    q = (w / scale[:, None]).to(fp8_module.FP8)
    x = torch.randn(rows, K, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), None if b is None else b.to(DEVICE)


@pytest.mark.parametrize("dtype,rows,bias,n", list(itertools.product([torch.float32, torch.bfloat16], [1, 5, 32, 64], [False, True], [96, 100])))
def test_fp8_linear_matches_the_dequantized_product(dtype, rows, bias, n):
    x, q, scale, b = _case(rows, n, dtype, bias, seed=rows * 7 + n)
    got = fp8_module.fp8_linear(x, q, scale, b)
    want = x.double() @ (q.double() * scale.double()[:, None]).t()
    if b is not None:
        want += b.double()
    assert got.dtype == dtype and got.shape == (rows, n)
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert err <= TOL[dtype], err
    ref = fp8_module.fp8_linear_ref(x, q, scale, b)
    assert ((got.double() - ref.double()).abs().max() / want.abs().max()).item() <= TOL[dtype]


@pytest.mark.parametrize("split_k,bias", [(2, False), (3, True), (7, True), (100, False)])
def test_a_split_k_loop_adds_its_partials_in_order(monkeypatch, split_k, bias):
    """K tiles of 32 over K = 200: 2 and 3 splits end on a partial tile, 7 leaves a split of one short tile, 100 asks
    more splits than there are tiles (the launcher takes fewer). Every split's partial is scaled once, after the sum."""
    monkeypatch.setattr(fp8_module, "_config", lambda *_: (16, 32, 4, 2, split_k))
    x, q, scale, b = _case(5, 100, torch.bfloat16, bias, seed=split_k)
    got = fp8_module.fp8_linear(x, q, scale, b)
    want = x.double() @ (q.double() * scale.double()[:, None]).t() + (b.double() if b is not None else 0)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= TOL[torch.bfloat16]
    monkeypatch.setattr(fp8_module, "_config", lambda *_: (16, 32, 4, 2, 1))
    assert torch.allclose(got.float(), fp8_module.fp8_linear(x, q, scale, b).float(), rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_fp8_linear_refuses_what_it_cannot_take():
    x, q, scale, _ = _case(4, 32, torch.float32, False, seed=3)
    with pytest.raises(AssertionError, match="at most 64 rows"):
        fp8_module.fp8_linear(torch.zeros(65, K, device=DEVICE), q, scale)
    with pytest.raises(AssertionError):
        fp8_module.fp8_linear(x, q.float(), scale)  # not FP8
    with pytest.raises(AssertionError):
        fp8_module.fp8_linear(x, q, scale.to(torch.float64))
    assert fp8_module.fp8_linear(x[:0], q, scale).shape == (0, 32)


def test_the_pipeline_fits_the_shared_memory_at_every_row_count():
    for rows in range(1, fp8_module.MAX_ROWS + 1):
        for n, k, elem in ((4096, 4096, 2), (14336 * 2, 4096, 2), (4096, 14336, 2), (512, 512, 4)):
            block_n, block_k, _, stages, _ = fp8_module._config(rows, n, k, elem)
            assert fp8_module.shared_bytes(rows, block_n, block_k, stages, elem) <= fp8_module.SHARED_BYTES
