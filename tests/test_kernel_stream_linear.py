"""The weight-stream decode projection (kernels/stream_linear.py) against float64, over bf16/fp16/fp32 weights and FP8
weights with per-row scales, whole and with its K loop split in one launch.

Grid (STYLE item 7): dtype x weight kind x rows (1, an odd 5, a graph bucket of 32, the most: 64) x bias x N (a panel
width that divides it, one that leaves a masked tail). K = 200 is a multiple of no BLOCK_K, so every K loop ends on a
masked tail; the FP8 scales span five decades, so a kernel that applies a wrong row's scale fails. The split K loop is
tested for its order (the partials added in split order, whichever split finishes last), for
the counters it leaves at 0, and for repeated launches that reuse them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(stream,) = import_kernels("kernels.stream_linear")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want|
K = 200


def _case(rows: int, n: int, dtype: torch.dtype, fp8: bool, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, K, generator=g) * torch.logspace(-2, 3, n)[torch.randperm(n, generator=g)][:, None]
    scale = None
    if fp8:
        scale = w.abs().amax(dim=1) / 448.0
        w = (w / scale[:, None]).to(stream.FP8)
        scale = scale.to(DEVICE)
    else:
        w = w.to(dtype)
    x = torch.randn(rows, K, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x.to(DEVICE), w.to(DEVICE), scale, None if b is None else b.to(DEVICE)


def _want(x, w, scale, b) -> torch.Tensor:
    wd = w.double() if scale is None else w.double() * scale.double()[:, None]
    return x.double() @ wd.t() + (b.double() if b is not None else 0)


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype,fp8,rows,bias,n", list(itertools.product(
    [torch.float32, torch.bfloat16], [False, True], [1, 5, 32, 64], [False, True], [128, 100])))  # fmt: skip
def test_stream_linear_matches_float64(dtype, fp8, rows, bias, n):
    x, w, scale, b = _case(rows, n, dtype, fp8, bias, seed=rows * 7 + n + fp8)
    got = stream.stream_linear(x, w, scale, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = _want(x, w, scale, b)
    assert _err(got, want) <= TOL[dtype]
    assert _err(stream.stream_linear_ref(x, w, scale, b), want) <= TOL[dtype]


def test_fp16_weights():
    x, w, _, b = _case(7, 100, torch.float16, False, True, seed=11)
    assert _err(stream.stream_linear(x, w, None, b), _want(x, w, None, b)) <= TOL[torch.float16]


@pytest.mark.parametrize("split_k,fp8,bias", [(2, False, False), (3, True, True), (7, False, True), (100, True, False)])
def test_a_split_k_loop_adds_its_partials_in_order_in_one_launch(monkeypatch, split_k, fp8, bias):
    """K tiles of 32 over K = 200: 2 and 3 splits end on a partial tile, 7 leaves a split of one short tile, 100 asks
    more splits than there are tiles (the launcher takes fewer). Every split's partial is added in split order by the
    last one, which scales once, after the sum: fp32 x fp32 matches the partials summed in that order to fp32 rounding."""
    monkeypatch.setattr(stream, "_config", lambda *_: (16, 32, 4, 2, split_k))
    x, w, scale, b = _case(5, 100, torch.float32, fp8, bias, seed=split_k)
    got = stream.stream_linear(x, w, scale, b)
    assert _err(got, _want(x, w, scale, b)) <= TOL[torch.float32]
    splits = min(split_k, 7)  # 200 / 32: 7 K tiles
    per = -(-(-(-K // splits)) // 32) * 32
    wf = w.float() if scale is None else w.float()
    parts = [x.float()[:, k:k + per] @ wf[:, k:k + per].t() for k in range(0, K, per)]
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    if scale is not None:
        total = total * scale.float()
    if b is not None:
        total = total + b.float()
    assert torch.allclose(got, total, rtol=1e-5, atol=1e-5 * total.abs().max().item())
    assert int(stream._counters(x.device).abs().sum()) == 0, "a launch left a panel counter set"


def test_repeated_split_launches_reuse_the_counters(monkeypatch):
    """The counters are shared by every launch on a device: launches of other shapes in a row each find them at 0
    and each give their own result (a counter left at 1 would let a first split finish a panel alone)."""
    monkeypatch.setattr(stream, "_config", lambda *_: (16, 32, 4, 2, 4))
    for i, n in enumerate((100, 48, 100, 130)):
        x, w, scale, b = _case(3 + i, n, torch.float32, i % 2 == 1, i % 2 == 0, seed=40 + i)
        for _ in range(2):
            assert _err(stream.stream_linear(x, w, scale, b), _want(x, w, scale, b)) <= TOL[torch.float32]
    assert int(stream._counters(x.device).abs().sum()) == 0


def test_stream_linear_refuses_what_it_cannot_take():
    x, w, scale, _ = _case(4, 32, torch.float32, True, False, seed=3)
    with pytest.raises(AssertionError, match="at most 64 rows"):
        stream.stream_linear(torch.zeros(65, K, device=DEVICE), w, scale)
    with pytest.raises(AssertionError, match="scale"):
        stream.stream_linear(x, w)  # FP8 without its scales
    with pytest.raises(AssertionError, match="scale"):
        stream.stream_linear(x, w.float(), scale)  # a scale for a weight in x's dtype
    with pytest.raises(AssertionError):
        stream.stream_linear(x, w, scale.to(torch.float64))
    with pytest.raises(AssertionError):
        stream.stream_linear(x.bfloat16(), w.float())  # weight in another dtype than x
    assert stream.stream_linear(x[:0], w, scale).shape == (0, 32)


def test_the_pipeline_fits_the_shared_memory_at_every_row_count():
    for rows in range(1, stream.MAX_ROWS + 1):
        for n, k, w_elem, x_elem in ((4096, 4096, 2, 2), (28672, 4096, 1, 2), (4096, 14336, 2, 2), (512, 512, 4, 4)):
            block_n, block_k, _, stages, _ = stream._config(rows, n, k, w_elem, x_elem)
            assert stream.shared_bytes(rows, block_n, block_k, stages, w_elem, x_elem) <= stream.SHARED_BYTES
