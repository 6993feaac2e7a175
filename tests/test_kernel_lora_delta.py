"""The one-launch multi-LoRA delta (kernels/lora_delta.py) against float64 at each adapter's true rank.

The grid of tests/test_kernel_lora.py for grouped rows (prefill sequences of 1 to 23 tokens, every fourth without an
adapter, mixed ranks with an empty slot, untargeted slices, pages shuffled and NaN behind every unused table entry):
z must be the delta on adapter rows and exactly zero elsewhere, every element written (z starts NaN in the kernel's
`torch.empty`, which a test cannot fill, so the check is that no NaN and no stray value survives). Column chunks and
tiles are also forced small, so that a slice is cut into several chunks and a chunk into several tiles with a masked
tail.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from tests.test_kernel_lora import RANKS, SLICES, SMALL, TOL, IN_FEATURES, Size, _assert_close, _batch, _paged, _want, _weights
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(lora_delta_module,) = import_kernels("kernels.lora_delta")
lora_delta = lora_delta_module.lora_delta

CASES = list(itertools.product([torch.float32, torch.bfloat16], ["distinct", "zipf", "identical"], RANKS, SLICES))


def _run(dtype, popularity, ranks, widths, gen, size: Size = SMALL, in_f: int = IN_FEATURES):
    max_rank, rank_list = ranks
    idx, segments = _batch("prefill", popularity, gen, size)
    n, num_slices, out_f = len(idx), len(widths), sum(widths)
    a, b, rank, scale = _weights(max_rank, rank_list, in_f, out_f, num_slices, dtype, gen, size.slots)
    x = torch.randn(n, in_f, generator=gen).to(dtype)
    zeros = torch.zeros(n, out_f, dtype=dtype)
    _, want = _want(x, zeros, a, b, rank, scale, idx, widths)  # float64 delta, 0 where no adapter writes
    a, b, rank, scale, x = (v.to(DEVICE) for v in (a, b, rank, scale, x))
    w = _paged(a, b, rank, scale, widths)
    assert lora_delta_module.fits(w, segments)
    z = lora_delta(x, w, segments, out_f)
    assert z.shape == (n, out_f) and z.dtype == dtype
    _assert_close(z, want.to(DEVICE), TOL[dtype], f"delta ({dtype})")
    assert torch.equal(z[want.to(DEVICE) == 0], torch.zeros_like(z[want.to(DEVICE) == 0])), "rows or slices without an adapter must be 0"


@pytest.mark.parametrize(("dtype", "popularity", "ranks", "slices"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_the_delta_matches_float64_at_true_rank_and_zero_elsewhere(dtype, popularity, ranks, slices):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), popularity, ranks, slices)).encode()))
    _run(dtype, popularity, RANKS[ranks], SLICES[slices], gen)


@pytest.mark.parametrize("round_t", [False, True], ids=["t_fp32", "t_rounded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_small_chunks_and_tiles_cut_every_slice_and_mask_their_tails(monkeypatch, dtype, round_t):
    """Chunks of 24 columns in 16-column tiles: q (64 wide) is three chunks, the last 16 wide; k and v (16) one each; a
    chunk's second tile is half past its end. 16-row tiles over sequences of 23 and 17 rows, 64-column K steps. With t
    rounded to the activations' dtype before its product with B (a config's choice), the same within the dtype's
    tolerance."""
    monkeypatch.setattr(lora_delta_module, "_config", lambda seg, in_f: (16, 16, 64, 24, 4, round_t))
    table = lora_delta_module.chunks(SLICES["qkv"], 24, DEVICE).cpu().tolist()
    assert table == [[0, 0, 24, 0, 64], [0, 24, 48, 0, 64], [0, 48, 64, 0, 64], [1, 64, 80, 64, 16], [2, 80, 96, 80, 16]]
    _run(dtype, "zipf", RANKS["mixed"], SLICES["qkv"], torch.Generator().manual_seed(5))


def test_long_sequences_and_a_wide_k():
    """Groups longer than a row tile many times over, and K of several steps plus a tail (the engine's prefill shapes, scaled down)."""
    size = Size(decode_rows=1, prefill_lens=(70, 130, 1, 45), slots=8)
    _run(torch.bfloat16, "distinct", RANKS["uniform"], SLICES["gate_up"], torch.Generator().manual_seed(9), size=size, in_f=333)


def test_it_refuses_a_batch_it_cannot_take():
    """Per-row groups (decode) have no `start`; a max rank past MAX_RANK_TILE would not fit a program's registers."""
    gen = torch.Generator().manual_seed(1)
    a, b, rank, scale = _weights(16, [16], 32, 48, 1, torch.float32, gen, 4)
    w = _paged(*(v.to(DEVICE) for v in (a, b, rank, scale)), (48,))
    _, grouped = _batch("prefill", "distinct", gen, Size(decode_rows=4, prefill_lens=(3, 2), slots=4))
    _, per_row = _batch("per_row", "distinct", gen, Size(decode_rows=4, prefill_lens=(3, 2), slots=4))
    assert lora_delta_module.fits(w, grouped) and not lora_delta_module.fits(w, per_row)
    a, b, rank, scale = _weights(200, [16], 32, 48, 1, torch.float32, gen, 2)
    wide = _paged(*(v.to(DEVICE) for v in (a, b, rank, scale)), (48,))
    assert not lora_delta_module.fits(wide, grouped)


def test_a_batch_past_the_byte_limit_goes_to_the_two_kernels(monkeypatch):
    """rows x (in + out) elements of x and z above MAX_BYTES: the GPU sets the pace there, and the two kernels are faster."""
    gen = torch.Generator().manual_seed(2)
    a, b, rank, scale = _weights(16, [16], 32, 48, 1, torch.float32, gen, 4)
    w = _paged(*(v.to(DEVICE) for v in (a, b, rank, scale)), (48,))
    _, grouped = _batch("prefill", "distinct", gen, Size(decode_rows=4, prefill_lens=(3, 2), slots=4))
    at = 5 * (32 + 48) * 4  # the batch's bytes
    monkeypatch.setattr(lora_delta_module, "MAX_BYTES", at)
    assert lora_delta_module.fits(w, grouped)
    monkeypatch.setattr(lora_delta_module, "MAX_BYTES", at - 1)
    assert not lora_delta_module.fits(w, grouped)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_a_later_layer_of_multi_layer_pages(dtype):
    """Pages hold a rank row of every layer (A's rows, then B's): the launch for layer 2 of 3 reads that layer's A row at
    layer x in and its B row of slice s at L x in + layer x w_s, for fused slices of different widths."""
    lora_segments = import_kernels("kernels.lora_segments")[0]
    gen = torch.Generator().manual_seed(31)
    layers, layer, in_f, widths, ranks = 3, 2, 40, (64, 16, 16), [[4, 8, 0], [16, 2, 5]]
    slots, max_rank = len(ranks), 16
    a = torch.randn(layers, slots, len(widths), max_rank, in_f, generator=gen) / in_f**0.5
    b = [torch.randn(layers, slots, max_rank, w, generator=gen) for w in widths]
    scale = torch.tensor([0.5, 2.0])
    chunks, table = [], torch.zeros(slots, len(widths), max_rank, dtype=torch.int64)
    offset = 0
    for i in range(slots):
        for s, w in enumerate(widths):
            for k in range(ranks[i][s]):
                page = torch.cat([a[:, i, s, k].reshape(-1), b[s][:, i, k].reshape(-1)])  # A's row of each layer, then B's
                table[i, s, k] = offset
                chunks.append(page)
                offset += page.numel()
    pool = torch.cat(chunks + [torch.full((in_f + max(widths),), float("nan"))]).to(dtype)
    table[table == 0] = offset  # unused entries (and slot 0 slice 0 row 0, re-set below) point at the NaN page
    table[0, 0, 0] = 0
    w = lora_segments.LoraPages(pool=pool.to(DEVICE), pages=table.to(DEVICE), rank=torch.tensor(ranks, dtype=torch.int32).to(DEVICE),
                                scale=scale.to(DEVICE), num_layers=layers, layer=layer, in_features=in_f, slices=widths)  # fmt: skip
    idx = [1] * 7 + [-1] * 3 + [0] * 20
    segments = lora_segments.segments_from_indices(idx, device=DEVICE)
    x = torch.randn(len(idx), in_f, generator=gen).to(dtype)
    want = torch.zeros(len(idx), sum(widths), dtype=torch.float64)
    for row, slot in enumerate(idx):
        col = 0
        for s, wd in enumerate(widths):
            r = ranks[slot][s] if slot >= 0 else 0
            if r:
                t = x[row].double() @ a[layer, slot, s, :r].to(dtype).double().T
                want[row, col : col + wd] = float(scale[slot]) * t @ b[s][layer, slot, :r].to(dtype).double()
            col += wd
    z = lora_delta(x.to(DEVICE), w, segments, sum(widths))
    _assert_close(z, want.to(DEVICE), TOL[dtype], f"layer {layer} of {layers} ({dtype})")
    assert (z[want.to(DEVICE) == 0] == 0).all()
