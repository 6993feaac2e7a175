"""SiLU x up with gate_up's LoRA delta added to its input (kernels.lora_segments.LoraDelta, engine.lora "Prefill").

Invariant: the fused op computes what kernels.lora_expand followed by the plain op computes, i.e. its input plus every
row's delta at the row's own rank, rounded once, then the op; rows without an adapter (or in an empty slot) get the
plain op. Grid (STYLE item 7): dtype x adapter popularity x rank mix x batch form (prefill segments of 1 to 23 tokens,
decode rows grouped by slot and padded as a graph bucket) at a width no tile divides, plus llama-8b's width. t and B
hold NaN beyond each slot's rank, so a kernel that reads past a rank fails.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

silu_mul, lora_segments = import_kernels("kernels.silu_mul", "kernels.lora_segments")
LoraDelta = lora_segments.LoraDelta

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# max |err| / max |want|: twice the plain ops' (tests/test_kernel_fused.py), as the input is rounded once more (x + delta
# to the dtype, as the expand rounds y), and the delta's TF32 products may tip that rounding to the neighbouring value
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3.2e-2}
POPULARITY = ("distinct", "zipf", "identical")
RANKS = {"uniform": (16, (16,)), "mixed": (64, (8, 16, 32, 64, 1, 0))}  # max rank, ranks cycled over the slots
FORMS = ("prefill", "grouped")
PREFILL_LENS = (5, 1, 23, 3, 17, 2)
NUM_SLOTS = 8


def _rows(form: str, popularity: str, gen: torch.Generator, lens: tuple[int, ...] = PREFILL_LENS) -> list[int]:
    """Adapter slot of every row; every fourth sequence (prefill, of `lens` tokens) or row (decode) has none."""
    units = len(lens) if form == "prefill" else 10
    if popularity == "distinct":
        unit = torch.arange(units) % NUM_SLOTS
    elif popularity == "zipf":
        unit = torch.multinomial(1.0 / torch.arange(1, NUM_SLOTS + 1, dtype=torch.float64) ** 1.5, units, replacement=True, generator=gen)
    else:
        unit = torch.zeros(units, dtype=torch.int64)
    unit[3::4] = -1
    if form == "prefill":
        return [int(s) for s, n in zip(unit, lens) for _ in range(n)]
    return sorted(unit.tolist(), key=lambda s: (s < 0, s))  # the engine orders decode rows by slot


def _delta(idx: list[int], widths: tuple[int, ...], ranks: str, form: str, dtype: torch.dtype, gen: torch.Generator) -> LoraDelta:
    """A LoraDelta over rows `idx`: t and B random at each slot's rank, NaN beyond it."""
    max_rank, cycle = RANKS[ranks]
    n, out = len(idx), sum(widths)
    rank = torch.tensor([cycle[s % len(cycle)] for s in range(NUM_SLOTS)], dtype=torch.int32)  # [slots]
    rank = rank[:, None].repeat(1, len(widths))  # [slots, S]; every third slot targets gate or up alone
    for s in range(0, NUM_SLOTS, 3):
        rank[s, (s // 3) % len(widths)] = 0
    b = torch.randn(NUM_SLOTS, max_rank, out, generator=gen) / max_rank**0.5  # [slots, R, out]
    t = torch.randn(len(widths), n, max_rank, generator=gen)  # [S, N, R]
    for i, s in enumerate(idx):
        for j in range(len(widths)):
            t[j, i, int(rank[s, j]) if s >= 0 else 0 :] = float("nan")
    scale = torch.rand(NUM_SLOTS, generator=gen) + 0.5  # [slots]
    if form == "prefill":
        seg = lora_segments.segments_from_indices(idx, device=DEVICE)
    else:
        seg = lora_segments.segments_from_indices(idx, device=DEVICE, pad_to=n)
    a = torch.zeros(NUM_SLOTS, len(widths), max_rank, 8)  # the op reads B alone
    # Pages in a shuffled order, NaN behind every unused table entry: a kernel that reads past a rank, into a slice the
    # adapter does not target, or beside the table, fails.
    weights = lora_segments.pack_pages(a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE), rank.to(DEVICE), scale.to(DEVICE), widths,
                                       generator=torch.Generator().manual_seed(3), fill=float("nan"))  # fmt: skip
    return LoraDelta(t=t.to(DEVICE), weights=weights, segments=seg)


def _plain_rows(idx: list[int], lora: LoraDelta) -> torch.Tensor:
    """[N] bool: rows whose op must equal the plain op's, bit for bit (no slot, or an empty slot)."""
    slot = torch.tensor(idx)
    return ((slot < 0) | (lora.weights.rank.cpu().long()[slot.clamp(min=0)] == 0).all(dim=1)).to(DEVICE)


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Bit for bit in the interpreter; within one unit in the last place on CUDA, where the compiler may contract the
    two kernels' arithmetic into fused multiply-adds differently."""
    if DEVICE.type == "cpu":
        assert torch.equal(got, want), what
    else:
        ulp = torch.finfo(got.dtype).eps * want.abs().clamp_min(torch.finfo(got.dtype).tiny)
        assert ((got.float() - want.float()).abs() <= ulp.float()).all(), what


def _check(got: torch.Tensor, want: torch.Tensor, tol: float, what: str) -> None:
    assert not got.isnan().any(), f"{what}: NaN in the output (a rank read past, or a row left unwritten)"
    err = (got.double() - want.double()).abs()
    scale = want.double().abs().max().clamp_min(1e-30)
    assert err.max() / scale <= tol, f"{what}: max rel err {float(err.max() / scale):.3e}, mean {float(err.mean() / scale):.3e}"


@pytest.mark.parametrize("dtype,popularity,ranks,form", list(itertools.product(DTYPES, POPULARITY, RANKS, FORMS)))
def test_silu_mul_with_lora_delta(dtype, popularity, ranks, form):
    """silu(g') * u' with g', u' = gate_up + each row's delta rounded once; plain rows as silu_mul's."""
    _silu_case(dtype, popularity, ranks, form, inter=200)  # no power of two: the column tiles end masked


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_with_lora_delta_at_llama_8b_width(dtype):
    """The same at llama-8b's intermediate size (14336), mixed ranks, a prefill of six sequences."""
    _silu_case(dtype, "zipf", "mixed", "prefill", inter=14336)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_with_lora_delta_over_long_sequences(dtype):
    """A prefill of long sequences (64 rows a group or more on average) takes the long groups' tiles (128 rows x 64
    columns) and computes the same op, a group's last tile past its end masked."""
    lens = (70, 130, 64, 90, 1)
    idx = _rows("prefill", "distinct", torch.Generator().manual_seed(0), lens)
    seg = lora_segments.segments_from_indices(idx, device=DEVICE)
    assert silu_mul._config(seg) == (128, 64, 8)
    _silu_case(dtype, "distinct", "mixed", "prefill", inter=200, lens=lens)


def _silu_case(dtype, popularity, ranks, form, inter, lens=PREFILL_LENS):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {popularity} {ranks} {form} {inter} {lens}".encode()))
    idx = _rows(form, popularity, gen, lens)
    gate_up = (torch.randn(len(idx), 2 * inter, generator=gen) * 2).to(dtype).to(DEVICE)
    lora = _delta(idx, (inter, inter), ranks, form, dtype, gen)
    out = silu_mul.silu_mul(gate_up, lora)
    want = silu_mul.silu_mul_ref(gate_up, lora)
    _check(out, want, TOL[dtype], f"silu_mul + LoRA {dtype} {popularity} {ranks} {form}")
    g, u = lora_segments.with_delta_ref(gate_up, lora).double().chunk(2, dim=-1)
    _check(out, g * torch.sigmoid(g) * u, TOL[dtype], "against float64")
    plain = _plain_rows(idx, lora)
    _same(out[plain], silu_mul.silu_mul(gate_up)[plain], "a row without an adapter must take the plain op")


def test_lora_delta_must_match_the_op():
    """A delta whose slices are not the op's (q, k, v; gate, up) is a programmer error, refused before any launch."""
    gen = torch.Generator().manual_seed(0)
    idx = _rows("prefill", "distinct", gen)
    gate_up = torch.randn(len(idx), 400, generator=gen).to(DEVICE)
    lora = _delta(idx, (150, 250), "uniform", "prefill", torch.float32, gen)
    with pytest.raises(AssertionError, match="slices"):
        silu_mul.silu_mul(gate_up, lora)
