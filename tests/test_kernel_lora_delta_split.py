"""The one-launch multi-LoRA delta with its K loop split (kernels/lora_delta_split.py) against float64 at each adapter's
true rank: tests/test_kernel_lora_delta.py's grid (its `_run`), with the split forced to 1, 2, 3 and more parts than K
has tiles, tiles forced small so that a slice is several column tiles with a masked tail, and the counters left at 0.
"""

from __future__ import annotations

import itertools
import zlib

import pytest
import torch

import tests.test_kernel_lora_delta as grid
from tests.test_kernel_lora import ISSUE, RANKS, SLICES
from tests.triton_interp import DEVICE, import_kernels, interpreter_env  # noqa: F401  (autouse fixture)

(split_module,) = import_kernels("kernels.lora_delta_split")


@pytest.fixture(autouse=True)
def _the_split_kernel(monkeypatch):
    monkeypatch.setattr(grid, "lora_delta_module", split_module)
    monkeypatch.setattr(grid, "lora_delta", split_module.lora_delta)


CASES = list(itertools.product([torch.float32, torch.bfloat16], ["distinct", "zipf"], RANKS, SLICES, [1, 2, 3, 64]))


@pytest.mark.parametrize(("dtype", "popularity", "ranks", "slices", "split"), CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_the_split_delta_matches_float64_at_true_rank_and_zero_elsewhere(monkeypatch, dtype, popularity, ranks, slices, split):
    monkeypatch.setattr(split_module, "_config", lambda *_: (16, 16, 16, split, 4, dtype != torch.float32))
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), popularity, ranks, slices, split)).encode()))
    grid._run(dtype, popularity, RANKS[ranks], SLICES[slices], gen)
    assert int(split_module._counters(DEVICE).abs().sum()) == 0, "a launch left a counter set"


def test_the_default_config_on_long_sequences_and_a_wide_k():
    gen = torch.Generator().manual_seed(5)
    grid._run(torch.bfloat16, "zipf", RANKS["mixed"], SLICES["qkv"], gen, ISSUE, in_f=640)
