"""Row groups for the multi-LoRA kernels (kernels/lora_segments.py): table-driven, host only, no Triton."""

from __future__ import annotations

import pytest
import torch

from kernels.lora_segments import rows_of, segments_from_indices, segments_per_row

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
