"""The Triton multi-LoRA shrink and expand against a float64 computation at each adapter's true rank.

Grid (STYLE item 7): dtype x adapter popularity x rank mix x fused slices x batch form, at small sizes that
the Triton interpreter runs on the CPU; the same checks at llama-1b and llama-8b hidden sizes run only
where CUDA is. Batch forms: per-row decode (BGMV groups of one row), decode rows grouped by slot and padded
as a CUDA graph would (SGMV, tiles of 16 rows), and a prefill of sequences of 1 to 23 tokens (SGMV, tiles
of 64 rows). Every fourth row or sequence has no adapter (-1), one slot of the mixed ranks is empty
(rank 0), every third slot of a fused projection leaves one slice untargeted (rank 0 there), and the weights are
paged in a shuffled order with every unused page-table entry pointing at NaN, so a kernel that reads past a rank
or into an untargeted slice, or ignores the table, fails; fresh outputs start filled with a sentinel, so one that
writes where it must not fails too.
"""

from __future__ import annotations

import itertools
import zlib
from dataclasses import dataclass

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)


lora_shrink_module, lora_expand_module, lora_segments_module = import_kernels(
    "kernels.lora_shrink", "kernels.lora_expand", "kernels.lora_segments"
)
lora_shrink, lora_shrink_ref = lora_shrink_module.lora_shrink, lora_segments_module.lora_shrink_ref
lora_expand, lora_expand_ref = lora_expand_module.lora_expand, lora_segments_module.lora_expand_ref
pack_pages = lora_segments_module.pack_pages
LoraSegments = lora_segments_module.LoraSegments
segments_from_indices, segments_per_row = lora_segments_module.segments_from_indices, lora_segments_module.segments_per_row
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # max |err| / max |want| of y
SENTINEL = -1.25e30  # fills a fresh output first: what the kernel leaves unwritten keeps it, computed NaN does not
T_TOL = 1e-5  # t is fp32 from exact products (fp32 holds a product of two fp16/bf16 exactly), whatever the input dtype
POPULARITY = ["distinct", "uniform", "zipf", "identical"]
RANKS = {"uniform": (16, [16]), "mixed": (64, [8, 16, 32, 64, 1, 0])}  # max rank, ranks cycled over the slots
SLICES = {"one": (48,), "qkv": (64, 16, 16), "gate_up": (40, 40)}  # qkv: llama-1b's 2048/512/512, scaled down
FORMS = ["per_row", "grouped", "prefill"]
IN_FEATURES = 200  # a multiple of no BLOCK_K: every K loop ends on a masked tail


@dataclass(frozen=True)
class Size:
    decode_rows: int
    prefill_lens: tuple[int, ...]  # tokens of each prefill sequence
    slots: int


SMALL = Size(decode_rows=10, prefill_lens=(5, 1, 23, 3, 17, 2), slots=16)
ISSUE = Size(decode_rows=32, prefill_lens=(70, 1, 130, 33, 64, 17, 96, 5), slots=32)  # issue 4: batch 32, 32 adapters



def _unit_slots(popularity: str, units: int, num_slots: int, gen: torch.Generator) -> list[int]:
    """Adapter slot of each unit (a decode row or a prefill sequence); every fourth has none."""
    if popularity == "distinct":
        slots = torch.arange(units) % num_slots
    elif popularity == "uniform":
        slots = torch.randint(0, num_slots, (units,), generator=gen)
    elif popularity == "zipf":
        weights = 1.0 / torch.arange(1, num_slots + 1, dtype=torch.float64) ** 1.5
        slots = torch.multinomial(weights, units, replacement=True, generator=gen)
    elif popularity == "identical":
        slots = torch.zeros(units, dtype=torch.int64)
    else:
        raise AssertionError(popularity)
    slots[3::4] = -1
    return slots.tolist()


def _batch(form: str, popularity: str, gen: torch.Generator, size: Size = SMALL) -> tuple[list[int], LoraSegments]:
    """Per-row slots [N] and the row groups the kernels take, for one batch form."""
    if form == "prefill":
        unit = _unit_slots(popularity, len(size.prefill_lens), size.slots, gen)
        idx = [s for s, n in zip(unit, size.prefill_lens) for _ in range(n)]
        return idx, segments_from_indices(idx, device=DEVICE)
    idx = _unit_slots(popularity, size.decode_rows, size.slots, gen)
    if form == "per_row":
        return idx, segments_per_row(torch.tensor(idx, device=DEVICE))
    idx = sorted(idx, key=lambda s: (s < 0, s))  # the engine may order decode rows by slot
    return idx, segments_from_indices(idx, device=DEVICE, pad_to=len(idx))


def _weights(max_rank, ranks, in_f, out_f, num_slices, dtype, gen, num_slots=SMALL.slots, targets="mixed"):
    """Dense slot stacks (a [slots, S, R, in], b [slots, R, out]) and per-slice ranks [slots, S], drawn on the
    generator's device. With mixed targets, every third slot of a fused projection leaves one slice untargeted (rank 0
    there), as an adapter of q and v leaves k; with ragged targets each slice has a rank of its own, none 0 but an empty
    slot's. Packed as pages (`_paged`), every table entry beyond a rank points at a
    NaN page, so a kernel that reads past a rank or into an untargeted slice fails."""
    dev = gen.device
    rank = torch.tensor([ranks[s % len(ranks)] for s in range(num_slots)], dtype=torch.int32, device=dev)  # [slots]
    rank2 = rank[:, None].repeat(1, num_slices)  # [slots, S]
    if targets == "mixed" and num_slices > 1:
        for s in range(0, num_slots, 3):
            rank2[s, (s // 3) % num_slices] = 0
    elif targets == "ragged":  # each slice its own rank: the first the slot's, the next half of it, a third of it, ...
        rank2 = torch.stack([torch.where(rank > 0, torch.clamp(rank // (j + 1), min=1), 0) for j in range(num_slices)], 1).to(torch.int32)
    a = torch.randn(num_slots, num_slices, max_rank, in_f, generator=gen, device=dev) / in_f**0.5  # [slots, S, R, in]
    b = torch.randn(num_slots, max_rank, out_f, generator=gen, device=dev)  # [slots, R, out]
    scale = torch.rand(num_slots, generator=gen, device=dev) * 2 + 0.25  # [slots]
    return a.to(dtype), b.to(dtype), rank2, scale


def _paged(a, b, rank, scale, widths, gen=None):
    """The stacks as the kernels read them: pages in a shuffled order, NaN behind every unused table entry."""
    return pack_pages(a, b, rank, scale, widths, generator=gen or torch.Generator().manual_seed(11), fill=float("nan"))


def _want(x, y0, a, b, rank, scale, idx, widths):
    """(t [S, N, R], y [N, out]) in float64 on the inputs' device, each slot at its true rank, one slot at a time."""
    num_slices, max_rank = a.shape[1], a.shape[2]
    slot = torch.tensor(idx, device=x.device)
    t = torch.zeros(num_slices, len(idx), max_rank, dtype=torch.float64, device=x.device)
    y = y0.double()
    for s in sorted(set(idx) - {-1}):
        rows = slot == s
        xs = x[rows].double()  # [m, in]
        col = 0
        for i, w in enumerate(widths):
            r = int(rank[s, i])
            if r == 0:
                col += w
                continue
            t[i, rows, :r] = xs @ a[s, i, :r].double().T
            y[rows, col : col + w] += float(scale[s]) * t[i, rows, :r] @ b[s, :r, col : col + w].double()
            col += w
    return t, y


def _defined(idx: list[int], rank: torch.Tensor, num_slices: int, max_rank: int) -> torch.Tensor:
    """[S, N, R] bool: the entries of t the shrink must write (a row's slot >= 0, column below its slice's rank)."""
    slot = torch.tensor(idx, dtype=torch.int64)
    r = torch.where(slot[:, None] >= 0, rank.long().cpu()[slot.clamp(min=0)], 0).T  # [S, N]
    return torch.arange(max_rank)[None, None, :] < r[:, :, None]


def _untouched(idx: list[int], rank: torch.Tensor, widths) -> torch.Tensor:
    """[N, out] bool: elements no adapter may write (no slot, or a slice of rank 0: empty or untargeted)."""
    slot = torch.tensor(idx, dtype=torch.int64)
    r = torch.where(slot[:, None] >= 0, rank.long().cpu()[slot.clamp(min=0)], 0)  # [N, S]
    return torch.repeat_interleave(r == 0, torch.tensor(widths), dim=1)


def _assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    err = (got.double() - want.to(got.device)).abs()
    scale = want.abs().max().clamp(min=1e-30)
    assert not torch.isnan(got).any(), f"{what}: NaN in the result ({int(torch.isnan(got).sum())} entries)"
    assert err.max() / scale < tol, f"{what}: max err {err.max():.3e} (rel {err.max() / scale:.3e} > {tol}), mean err {err.mean():.3e}"


def _bits(y: torch.Tensor) -> torch.Tensor:
    return y.view(torch.int32 if y.element_size() == 4 else torch.int16)


def _run_case(dtype, popularity, ranks, widths, form, in_f, gen, size: Size = SMALL, data_gen: torch.Generator | None = None,
              targets: str = "mixed"):  # fmt: skip
    """One grid case; `gen` draws the batch, `data_gen` (default `gen`) the tensors, on its own device."""
    data_gen = data_gen or gen
    max_rank, rank_list = ranks
    idx, segments = _batch(form, popularity, gen, size)
    n, num_slices, out_f = len(idx), len(widths), sum(widths)
    a, b, rank, scale = _weights(max_rank, rank_list, in_f, out_f, num_slices, dtype, data_gen, size.slots, targets=targets)
    x = torch.randn(n, in_f, generator=data_gen, device=data_gen.device).to(dtype)  # [N, in]
    y0 = torch.randn(n, out_f, generator=data_gen, device=data_gen.device).to(dtype)  # [N, out]
    y0[:, ::3] = -0.0  # untouched rows must keep these bits; y + 0.0 would turn them into +0.0
    t_want, y_want = _want(x, y0, a, b, rank, scale, idx, widths)
    defined = _defined(idx, rank, num_slices, max_rank).to(DEVICE)
    a, b, rank, scale, x, y = (v.to(DEVICE) for v in (a, b, rank, scale, x, y0.clone()))
    w = _paged(a, b, rank, scale, widths)

    t = lora_shrink(x, w, segments, out=torch.full((num_slices, n, max_rank), SENTINEL, device=DEVICE))
    _assert_close(t[defined], t_want.to(DEVICE)[defined], T_TOL, "shrink t")
    outside = t[~defined]  # rows without an adapter, columns beyond a rank: never written
    zeroed = lora_shrink_module._config(segments, num_slices, in_f)[0] > 1  # split-K zeroes t before adding into it
    assert ((outside == SENTINEL) | (zeroed & (outside == 0))).all(), f"shrink wrote {int((outside != SENTINEL).sum())} entries it must not"
    t[~defined] = float("nan")  # whatever the shrink left there: the expand must not read it

    lora_expand(y, t, w, segments)
    keep = _untouched(idx, rank, widths).to(DEVICE)
    assert torch.equal(_bits(y[keep]), _bits(y0.to(DEVICE)[keep])), "rows without an adapter, or slices it does not target, changed"
    _assert_close(y, y_want, TOL[dtype], f"expand y ({dtype})")

    # The delta form (accumulate=False): every element written, none read; the delta on adapter rows, 0 elsewhere.
    z = torch.full_like(y, float("nan"))
    lora_expand(z, t, w, segments, accumulate=False)
    assert (z[keep] == 0).all(), "rows without an adapter: the delta must be written as zeros"
    _assert_close(z, (y_want - y0.double()).to(DEVICE), TOL[dtype], f"expand delta ({dtype})")


# fp16 runs the bf16 cases' code (another 16-bit type on the same tensor-core path): its cases take one slice layout,
# the fused qkv one (48 cases fewer, about 35 s of the suite)
CASES = [c for c in itertools.product([torch.float32, torch.float16, torch.bfloat16], POPULARITY, RANKS, SLICES, FORMS)
         if c[0] != torch.float16 or c[3] == "qkv"]


@pytest.mark.parametrize(("dtype", "popularity", "ranks", "slices", "form"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_shrink_expand_match_true_rank_float64_and_leave_unadapted_rows_untouched(dtype, popularity, ranks, slices, form):
    """t equals x A^T at each slot's true rank on every entry it must write and nothing else of a sentinel-filled
    buffer changes; y += s t B^T equals float64 within the dtype's tolerance without reading t or weights beyond a
    rank (NaN there); rows with no adapter or an empty slot keep their bits."""
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), popularity, ranks, slices, form)).encode()))
    _run_case(dtype, popularity, RANKS[ranks], SLICES[slices], form, IN_FEATURES, gen)


@pytest.mark.parametrize("form", FORMS)
def test_torch_references_match_float64(form):
    """lora_shrink_ref and lora_expand_ref (what the bench times the kernels against) compute the same op."""
    gen = torch.Generator().manual_seed(7)
    max_rank, rank_list = RANKS["mixed"]
    widths = SLICES["qkv"]
    idx, segments = _batch(form, "uniform", gen)
    a, b, rank, scale = _weights(max_rank, rank_list, IN_FEATURES, sum(widths), len(widths), torch.float32, gen)
    x = torch.randn(len(idx), IN_FEATURES, generator=gen)
    y0 = torch.randn(len(idx), sum(widths), generator=gen)
    t_want, y_want = _want(x, y0, a, b, rank, scale, idx, widths)
    segments_cpu = LoraSegments(segments.slot.cpu(), None if segments.start is None else segments.start.cpu(), segments.max_len, segments.num_rows)
    w = _paged(a, b, rank, scale, widths)
    t = lora_shrink_ref(x, w, segments_cpu)
    _assert_close(t, t_want, 1e-5, "lora_shrink_ref")
    y = y0.clone()
    lora_expand_ref(y, t, w, segments_cpu)
    _assert_close(y, y_want, 1e-5, "lora_expand_ref")
    z = torch.full_like(y0, float("nan"))
    lora_expand_ref(z, t, w, segments_cpu, accumulate=False)
    _assert_close(z, y_want - y0.double(), 1e-5, "lora_expand_ref delta")


@pytest.mark.parametrize("row_tiles", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_expand_with_several_row_tiles_per_program(monkeypatch, dtype, row_tiles):
    """Prefill expand programs that each take several row tiles (the last ones past their group's end) compute what
    float64 does and leave rows without an adapter untouched, over mixed ranks and the fused qkv slices."""
    default = lora_expand_module._config
    monkeypatch.setattr(lora_expand_module, "_config", lambda seg, accumulate=True: (16, 64, 4, row_tiles) if seg.start is not None else default(seg, accumulate))
    gen = torch.Generator().manual_seed(17 + row_tiles)
    _run_case(dtype, "zipf", RANKS["mixed"], SLICES["qkv"], "prefill", IN_FEATURES, gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_expand_delta_over_long_sequences_takes_the_long_tiles(dtype):
    """A prefill of long sequences (64 rows a group or more on average) writes its delta in 128-row tiles at 8 warps,
    and the shrink and both expand forms still compute what float64 does (a group's last tile past its end masked)."""
    size = Size(decode_rows=10, prefill_lens=(70, 130, 64, 90, 1), slots=16)
    _, segments = _batch("prefill", "distinct", torch.Generator().manual_seed(0), size)
    assert lora_expand_module._config(segments, accumulate=False) == (128, 256, 8, 1)
    assert lora_expand_module._config(segments, accumulate=True) == (32, 128, 4, 1)
    gen = torch.Generator().manual_seed(23)
    _run_case(dtype, "distinct", RANKS["mixed"], SLICES["qkv"], "prefill", IN_FEATURES, gen, size=size)


@pytest.mark.parametrize("form", ["per_row", "prefill"])
@pytest.mark.parametrize("num_slices", [1, 3])
def test_split_k_adds_up_to_the_same_t(monkeypatch, form, num_slices):
    """With K split 4 ways (fp32 atomics into a zeroed t) the shrink gives what one pass gives, GEMV and tiles alike,
    one slice or three."""
    gen = torch.Generator().manual_seed(3)
    idx, segments = _batch(form, "uniform", gen)
    a, _, rank, _ = _weights(32, [8, 16, 32], 256, 16, num_slices, torch.float32, gen)
    x = torch.randn(len(idx), 256, generator=gen)
    a, rank, x = a.to(DEVICE), rank.to(DEVICE), x.to(DEVICE)
    w = _paged(a, torch.zeros(a.shape[0], 32, 16 * num_slices, device=DEVICE), rank, torch.ones(a.shape[0], device=DEVICE), (16,) * num_slices)
    assert lora_shrink_module._config(segments, num_slices, 256)[0] == 1
    one_pass = lora_shrink(x, w, segments)
    monkeypatch.setattr(lora_shrink_module, "_MIN_K_PER_SPLIT", 64)
    monkeypatch.setattr(lora_shrink_module, "_TARGET_PROGRAMS", 10**6)
    monkeypatch.setattr(lora_shrink_module, "_PREFILL_TARGET_PROGRAMS", 10**6)
    assert lora_shrink_module._config(segments, num_slices, 256)[0] == 4  # 4 splits of 64: the last that keeps >= 64
    split = lora_shrink(x, w, segments, out=torch.full_like(one_pass, float("nan")))
    defined = _defined(idx, rank.cpu(), num_slices, 32).to(DEVICE)
    torch.testing.assert_close(split[defined], one_pass[defined], rtol=1e-5, atol=1e-5)
    # out_zeroed: the caller zeroed `out` (one memset for many launches); the splits add into it as it is
    pre = lora_shrink(x, w, segments, out=torch.zeros_like(one_pass), out_zeroed=True)
    torch.testing.assert_close(pre[defined], one_pass[defined], rtol=1e-5, atol=1e-5)
    ones = lora_shrink(x, w, segments, out=torch.ones_like(one_pass), out_zeroed=True)
    torch.testing.assert_close(ones[defined], one_pass[defined] + 1, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize(("ranks", "slices", "targets"), [("mixed", "qkv", "mixed"), ("mixed", "gate_up", "mixed"), ("uniform", "qkv", "mixed"),
                                                          ("mixed", "qkv", "ragged")])
@pytest.mark.parametrize("form", ["grouped", "prefill"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda v: str(v).replace("torch.", ""))
def test_fused_slices_tile_matches_float64(monkeypatch, dtype, form, ranks, slices, targets, split_k):
    """Tiles computing all slices of a rank tile in one program (FUSED_SLICES: one x tile against every slice's A rows,
    a slice of rank 0 or past its rank masked out) give the grid's answers, written where the per-slice tiles write
    and nowhere else, whole or with K split and added into a zeroed t; also where each slice of a slot has a rank of
    its own (ragged: q 64, k 32, v 21), so one rank tile is live in some slices and past the rank in others."""
    default = lora_shrink_module._config
    monkeypatch.setattr(lora_shrink_module, "_config", lambda seg, num_slices, in_f: (split_k, 16, 64, 4, 2, True)
                        if seg.start is not None else default(seg, num_slices, in_f))  # fmt: skip
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), form, ranks, slices, targets, split_k)).encode()))
    _run_case(dtype, "zipf", RANKS[ranks], SLICES[slices], form, IN_FEATURES, gen, targets=targets)


@pytest.mark.parametrize("form", ["per_row", "prefill"])
def test_empty_batch_and_all_base_batch_change_nothing(form):
    """No rows, or rows all without an adapter: y keeps every bit and nothing is launched for nothing."""
    gen = torch.Generator().manual_seed(4)
    w = _paged(*(v.to(DEVICE) for v in _weights(16, [16], 32, 24, 1, torch.float32, gen)), (24,))
    for idx in ([], [-1] * 5):
        segments = segments_per_row(torch.tensor(idx, dtype=torch.int64, device=DEVICE)) if form == "per_row" else segments_from_indices(idx, device=DEVICE)
        x = torch.randn(len(idx), 32, generator=gen).to(DEVICE)
        y = torch.randn(len(idx), 24, generator=gen).to(DEVICE)
        before = y.clone()
        t = lora_shrink(x, w, segments)
        assert t.shape == (1, len(idx), 16)
        lora_expand(y, t, w, segments)
        assert torch.equal(_bits(y), _bits(before))


def test_scale_is_per_slot():
    """Two rows with the same x but slots that differ only in scale get deltas in exactly that ratio."""
    gen = torch.Generator().manual_seed(5)
    a, b, rank, scale = _weights(16, [16], 32, 32, 1, torch.float32, gen)
    a[1], b[1] = a[0], b[0]
    scale[0], scale[1] = 0.5, 2.0
    w = _paged(*(v.to(DEVICE) for v in (a, b, rank, scale)), (32,))
    x = torch.randn(1, 32, generator=gen).to(DEVICE).expand(2, -1).contiguous()
    y = torch.zeros(2, 32, device=DEVICE)
    segments = segments_per_row(torch.tensor([0, 1], device=DEVICE))
    lora_expand(y, lora_shrink(x, w, segments), w, segments)
    torch.testing.assert_close(y[1], 4 * y[0], rtol=1e-6, atol=1e-6)


# Real hidden sizes: (in, slice widths) of llama-1b and llama-8b projections; compiled kernels on CUDA only.
REAL = {
    "1b-qkv": (2048, (2048, 512, 512)),
    "1b-gate_up": (2048, (8192, 8192)),
    "1b-down": (8192, (2048,)),
    "8b-qkv": (4096, (4096, 1024, 1024)),
    "8b-o": (4096, (4096,)),
    "8b-down": (14336, (4096,)),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real hidden sizes need CUDA (the interpreter would take hours)")
@pytest.mark.parametrize(
    ("dtype", "module", "ranks", "form"),
    list(itertools.product([torch.float32, torch.bfloat16], REAL, RANKS, FORMS)),
    ids=lambda v: str(v).replace("torch.", ""),
)
def test_real_hidden_sizes_on_cuda(dtype, module, ranks, form):
    """The same checks as the small grid at llama-1b/-8b projection sizes, batch 32 over 32 distinct adapters."""
    in_f, widths = REAL[module]
    seed = zlib.crc32(repr((str(dtype), module, ranks, form)).encode())
    gen, data_gen = torch.Generator().manual_seed(seed), torch.Generator(device=DEVICE).manual_seed(seed)
    _run_case(dtype, "distinct", RANKS[ranks], widths, form, in_f, gen, ISSUE, data_gen)
