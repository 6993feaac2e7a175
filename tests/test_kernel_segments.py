"""Row groups for the multi-LoRA kernels (kernels/lora_segments.py): table-driven, host only, no Triton."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_segments import _rows, rows_of, segments_from_indices, segments_per_row

CASES = [
    # (name, per-row slots, want start, want slot, want max_len)
    ("docstring example", [2, 2, 2, -1, -1, 0, 0, 2], [0, 3, 5, 7, 8], [2, -1, 0, 2], 3),
    ("sorted by slot", [0, 0, 2, 2, 2, 2, -1, -1], [0, 2, 6, 8], [0, 2, -1], 4),
    ("empty batch", [], [0], [], 0),
    ("one row", [5], [0, 1], [5], 1),
    ("no row has an adapter", [-1, -1, -1], [0, 3], [-1], 3),
    ("every row its own adapter", [3, 1, 4, 1], [0, 1, 2, 3, 4], [3, 1, 4, 1], 1),
]


@pytest.mark.parametrize(("name", "idx", "start", "slot", "max_len"), CASES, ids=[c[0] for c in CASES])
def test_runs_of_equal_slots_become_groups(name, idx, start, slot, max_len):
    """Groups are the maximal runs of equal consecutive slots, in order, covering all N rows; -1 runs are kept."""
    seg = segments_from_indices(idx, device="cpu")
    assert seg.start.tolist() == start and seg.slot.tolist() == slot
    assert (seg.max_len, seg.num_rows, seg.num_groups) == (max_len, len(idx), len(slot))
    assert seg.start.dtype == seg.slot.dtype == torch.int32


@pytest.mark.parametrize("idx", [c[1] for c in CASES] + [torch.randint(-1, 6, (200,), generator=torch.Generator().manual_seed(0)).tolist()])
def test_rows_of_inverts_both_builders(idx):
    """Expanding the groups back to rows gives the per-row slots, for the run builder and the per-row one."""
    assert rows_of(segments_from_indices(idx, device="cpu")).tolist() == idx
    assert rows_of(segments_from_indices(torch.tensor(idx, dtype=torch.int64), device="cpu")).tolist() == idx
    per_row = segments_per_row(torch.tensor(idx, dtype=torch.int64))
    assert per_row.start is None and per_row.max_len == 1 and rows_of(per_row).tolist() == idx


def test_pad_to_fixes_the_grid_for_cuda_graphs():
    """pad_to appends empty groups (start == end == N, slot -1) and sets max_len to N: the grid depends on N alone."""
    seg = segments_from_indices([1, 1, -1, 4], device="cpu", pad_to=6)
    assert seg.start.tolist() == [0, 2, 3, 4, 4, 4, 4]
    assert seg.slot.tolist() == [1, -1, 4, -1, -1, -1]
    assert seg.max_len == 4 and seg.num_groups == 6
    assert rows_of(seg).tolist() == [1, 1, -1, 4]
    with pytest.raises(AssertionError, match="pad_to 2 is below the 3 groups"):
        segments_from_indices([1, 1, -1, 4], device="cpu", pad_to=2)


def test_slots_below_minus_one_are_refused():
    """-1 means no adapter; anything lower is a caller's bug, caught before a kernel reads slot -2."""
    with pytest.raises(AssertionError, match="below -1"):
        segments_from_indices([0, -2], device="cpu")


ROW_OFFSETS = [
    # (name, offsets into a pool of 10, width)
    ("one", [[3]], 4),
    ("overlapping and repeated", [[0, 2], [2, 6]], 4),
    ("past the end: the last full row", [[7, 9, 10**6]], 4),
    ("before the start: the first", [[-1, -(10**6)]], 3),
    ("the whole pool", [[0]], 10),
    ("none", torch.empty(0, 5, dtype=torch.int64), 4),
]


@pytest.mark.parametrize(("name", "offsets", "width"), ROW_OFFSETS, ids=[c[0] for c in ROW_OFFSETS])
def test_rows_gathers_pool_slices_clamped_into_the_pool(name, offsets, width):
    """_rows (the references' page reads) gives pool[o : o + width] for every offset o, shaped [*offsets, width], an
    offset outside the pool read at the nearest one inside, and a fresh tensor: writing it leaves the pool alone."""
    pool = torch.arange(10, dtype=torch.float32)
    offsets = torch.as_tensor(offsets, dtype=torch.int64)
    got = _rows(pool, offsets, width)
    assert got.shape == (*offsets.shape, width)
    flat = [min(max(o, 0), 10 - width) for o in offsets.flatten().tolist()]
    want = torch.stack([pool[o : o + width] for o in flat]) if flat else torch.empty(0, width)
    assert torch.equal(got.reshape(-1, width), want), (got, want)
    got.fill_(-1.0)
    assert torch.equal(pool, torch.arange(10, dtype=torch.float32))
