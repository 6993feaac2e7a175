"""The multi-LoRA references (kernels.lora_segments: the kernels' reference and the torch backend) against a naive
per-row loop in float64.

Grid (STYLE item 7): dtype x max rank x batch x adapter popularity x hidden sizes; every slot has its own
true rank, its rows paged in a shuffled order with every table entry past it pointing at NaN (nothing there may be
read), and about a quarter of the rows have no adapter (idx -1).
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import kernels.lora_segments as lora_segments_module
from kernels.lora_segments import lora_expand_ref, lora_shrink_ref, pack_pages, segments_per_row

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max |err| / max |ref| per case
SIZES = [(128, 352), (352, 128), (4096, 1024)]  # (in, out): the demo's MLP, and a Llama-8B k/v projection


def _indices(popularity: str, batch: int, slots: int, gen: torch.Generator) -> torch.Tensor:
    if popularity == "distinct":
        idx = torch.arange(batch) % slots
    elif popularity == "uniform":
        idx = torch.randint(0, slots, (batch,), generator=gen)
    elif popularity == "zipf":
        weights = 1.0 / torch.arange(1, slots + 1, dtype=torch.float64) ** 1.5
        idx = torch.multinomial(weights, batch, replacement=True, generator=gen)
    elif popularity == "identical":
        idx = torch.zeros(batch, dtype=torch.int64)
    else:
        raise AssertionError(popularity)
    idx[3::4] = -1  # rows without an adapter
    return idx.to(torch.int64)


def _slot_weights(slots: int, max_rank: int, in_f: int, out_f: int, dtype: torch.dtype, gen: torch.Generator, pad=float("nan")):
    """Stacks in the kernels' layout, `pad` beyond each slot's own rank."""
    ranks = torch.randint(1, max_rank + 1, (slots,), generator=gen).to(torch.int32)  # [slots]
    a = torch.randn(slots, max_rank, in_f, generator=gen) / in_f**0.5  # [slots, R, in]
    b = torch.randn(slots, max_rank, out_f, generator=gen)  # [slots, R, out]
    for s, r in enumerate(ranks.tolist()):
        a[s, r:] = pad
        b[s, r:] = pad
    scale = torch.rand(slots, generator=gen) * 2 + 0.25  # [slots]
    return a.to(dtype), b.to(dtype), scale, ranks


def _paged(a, b, scale, ranks):
    """The stacks as pages in a shuffled order, NaN behind every table entry past a rank (nothing there may be read)."""
    return pack_pages(a.unsqueeze(1), b, ranks, scale, (b.shape[2],), generator=torch.Generator().manual_seed(9), fill=float("nan"))


def _lora(y, x, a, b, idx, scale, ranks) -> None:
    """The whole op through the references: shrink, then expand into y."""
    segments = segments_per_row(idx)
    w = _paged(a, b, scale, ranks)
    lora_expand_ref(y, lora_shrink_ref(x, w, segments), w, segments)


def _naive(y, x, a, b, idx, scale, ranks) -> torch.Tensor:
    """Row by row in float64, each adapter at its true rank (no padding involved)."""
    out = y.double().clone()
    for i, s in enumerate(idx.tolist()):
        if s < 0:
            continue
        r = int(ranks[s])
        out[i] += float(scale[s]) * (x[i].double() @ a[s, :r].double().T) @ b[s, :r].double()
    return out


CASES = list(
    itertools.product([torch.float32, torch.bfloat16], [4, 16, 64], [1, 7, 64], ["distinct", "uniform", "zipf", "identical"], SIZES)
)


@pytest.mark.parametrize(("dtype", "max_rank", "batch", "popularity", "size"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_matches_naive_loop_and_leaves_unadapted_rows_untouched(dtype, max_rank, batch, popularity, size):
    """y += s * (x A^T) B^T per row equals the naive loop within the dtype's tolerance, reading nothing beyond a rank
    (NaN there); rows with idx -1 are bit-identical."""
    in_f, out_f = size
    gen = torch.Generator().manual_seed(zlib.crc32(repr((max_rank, batch, popularity, size)).encode()))  # stable across runs
    slots = max(8, batch) if popularity == "distinct" else 8
    a, b, scale, ranks = _slot_weights(slots, max_rank, in_f, out_f, dtype, gen)
    x = torch.randn(batch, in_f, generator=gen).to(dtype)  # [N, in]
    y = torch.randn(batch, out_f, generator=gen).to(dtype)  # [N, out]
    idx = _indices(popularity, batch, slots, gen)
    want = _naive(y, x, a, b, idx, scale, ranks)
    before = y.clone()

    _lora(y, x, a, b, idx, scale, ranks)

    assert not torch.isnan(y).any(), "NaN: a weight beyond a rank was read"
    err = (y.double() - want).abs()
    rel = err.max() / want.abs().max()
    assert rel < TOL[dtype], f"max rel err {rel:.3e} (mean abs err {err.mean():.3e}) > {TOL[dtype]} for {dtype}"
    untouched = idx < 0
    assert torch.equal(y[untouched], before[untouched]), "rows without an adapter changed"


def test_shrink_is_zero_for_rows_without_adapter_and_beyond_each_rank():
    """t has zeros for idx -1 rows and in the columns from a slot's rank on, whatever the weights hold there."""
    gen = torch.Generator().manual_seed(0)
    a, _, _, ranks = _slot_weights(4, 16, 32, 8, torch.float32, gen)
    x = torch.randn(6, 32, generator=gen)
    idx = torch.tensor([0, -1, 1, 2, -1, 3])
    t = lora_shrink_ref(x, _paged(a, torch.zeros(4, 16, 8), torch.ones(4), ranks), segments_per_row(idx))  # [1, 6, 16]
    assert t.shape == (1, 6, 16) and t.dtype == torch.float32
    assert torch.equal(t[0, idx < 0], torch.zeros(2, 16))
    for i, s in enumerate(idx.tolist()):
        if s >= 0:
            assert torch.count_nonzero(t[0, i, int(ranks[s]) :]) == 0


@pytest.mark.parametrize(
    ("batch", "idx_fill"),
    [(0, -1), (5, -1)],
    ids=["empty batch", "no row has an adapter"],
)
def test_empty_and_all_base_batches_change_nothing(batch, idx_fill):
    """An empty batch, or one where every row has idx -1, leaves y exactly as it was."""
    gen = torch.Generator().manual_seed(1)
    a, b, scale, ranks = _slot_weights(3, 8, 16, 24, torch.float32, gen)
    x = torch.randn(batch, 16, generator=gen)
    y = torch.randn(batch, 24, generator=gen)
    before = y.clone()
    _lora(y, x, a, b, torch.full((batch,), idx_fill, dtype=torch.int64), scale, ranks)
    assert torch.equal(y, before)


def test_row_chunking_gives_the_same_result(monkeypatch):
    """Splitting the gather into many chunks (tiny memory cap) changes nothing in the result."""
    gen = torch.Generator().manual_seed(2)
    a, b, scale, ranks = _slot_weights(5, 16, 64, 48, torch.float32, gen)
    x = torch.randn(37, 64, generator=gen)
    idx = _indices("uniform", 37, 5, gen)
    y_one = torch.randn(37, 48, generator=gen)
    y_many = y_one.clone()
    _lora(y_one, x, a, b, idx, scale, ranks)
    monkeypatch.setattr(lora_segments_module, "_GATHER_BYTES", 16 * 64 * 4 * 3)  # 3 rows per chunk
    _lora(y_many, x, a, b, idx, scale, ranks)
    assert torch.allclose(y_one, y_many, rtol=1e-6, atol=1e-6)


def test_expand_applies_each_slots_scale():
    """Two rows with the same t but slots of different scale differ exactly by the scale ratio."""
    b = torch.ones(2, 4, 3)  # [slots, R, out]
    t = torch.ones(1, 2, 4)  # [S, N, R]
    y = torch.zeros(2, 3)
    w = _paged(torch.zeros(2, 4, 5), b, torch.tensor([0.5, 2.0]), torch.tensor([4, 4]))
    lora_expand_ref(y, t, w, segments_per_row(torch.tensor([0, 1])))
    assert torch.equal(y, torch.tensor([[2.0] * 3, [8.0] * 3]))
