"""Row groups for the multi-LoRA kernels (which rows of a flat batch share an adapter slot), and the ops' references.

Semantics: group g covers rows start[g] .. start[g+1] - 1, all with adapter slot[g] (-1: no adapter), or
row g alone when `start` is None.

The shrink and expand kernels (kernels/lora_shrink.py, kernels/lora_expand.py) launch one program per
(group, tile of BLOCK_M rows of that group), so every weight tile of a slot is read once per row tile
rather than once per row. Two ways to build the groups:

- `segments_per_row(slot_idx)`: every row its own group, the slot taken straight from the per-row index
  on the device (Punica's BGMV). No host work and no sync, so it serves CUDA-graph decode where the
  per-row slot index is the graph's input.
- `segments_from_indices(slot_idx, device=...)`: runs of equal consecutive indices (Punica's SGMV
  segments), built on the host from the scheduler's own lists; nothing waits on the device. Rows need not
  be sorted: an unsorted batch just has more, shorter runs. Prefill tokens of one sequence are consecutive
  and share an adapter, so a prefill of B sequences is at most B runs; ordering sequences by slot (the
  engine may) merges runs of the same adapter into one.

Running example, per-token slots of three prompts and one decode token:

    slot_idx = [2, 2, 2, -1, -1, 0, 0, 2]    # 3 tokens of slot 2, 2 with no adapter, 2 of slot 0, 1 of slot 2
    start    = [0, 3, 5, 7, 8]               # G = 4 groups; the last entry is N = 8
    slot     = [2, -1, 0, 2]
    max_len  = 3                             # sizes the row-tile grid axis: cdiv(3, BLOCK_M) tiles per group

The kernels launch 4 x cdiv(3, BLOCK_M) programs per column tile; group 1 (slot -1) returns at once and
leaves its rows untouched. Sorted by slot (0, 0, 2, 2, 2, 2, -1, -1) the batch is 3 groups, and slot 2's
weights are read once for its 4 rows instead of twice.

For CUDA graphs, `pad_to` gives a fixed group count (empty groups `start == end`, slot -1, at the end)
and sets max_len to N, so the grid depends on N alone.

References. `lora_shrink_ref` and `lora_expand_ref` are the shrink's and the expand's one pure-torch reference each,
with the kernels' signatures and layouts (`a_stack [slots, S, R, in]`, `b_stack [slots, R, out]`, t `[S, N, R]` fp32),
in fp32 at each slot's true rank. They live here, beside the row groups and not in the kernel files, because they are
also the engine's torch backend (engine.backend), which must run where triton is not installed (the CPU default;
triton is a dev extra). Each gathers every row's slot weights and runs one batched matmul per chunk of rows: no Python
loop over adapters and no `nonzero()` or `.tolist()`, so the op never waits on the device and its cost does not grow
with the number of distinct adapters. Rows without an adapter are computed with slot 0 and masked out, as are the
columns from each row's rank on (whatever t or the weights hold there). Gathered weights cost rows x max_rank x
features x 4 B: a 8192-token prefill of a 4096 -> 14336 projection at rank 64 would gather 30 GB, so rows go in chunks
of at most `_GATHER_BYTES` (256 MiB: 73 rows in that example, all of a typical decode batch in one chunk).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_GATHER_BYTES = 256 * 1024 * 1024  # the most weight bytes a reference gathers at once ("References" above)


@dataclass(frozen=True)
class LoraSegments:
    slot: torch.Tensor  # [G] int32 or int64, on the kernels' device: adapter slot of each group, -1 for none
    start: torch.Tensor | None  # [G + 1] int32: group g is rows start[g] .. start[g+1] - 1; None: group g is row g
    max_len: int  # rows in the longest group, or an upper bound of it (it sizes the grid, nothing more)
    num_rows: int  # N: rows of the batch the groups cover

    @property
    def num_groups(self) -> int:
        return self.slot.numel()


def segments_per_row(slot_idx: torch.Tensor) -> LoraSegments:  # slot_idx: [N] int, on the device
    """Each row its own group (BGMV): no host work, no sync, safe inside a CUDA graph."""
    assert slot_idx.dim() == 1 and slot_idx.dtype in (torch.int32, torch.int64), (slot_idx.shape, slot_idx.dtype)
    return LoraSegments(slot=slot_idx, start=None, max_len=1, num_rows=slot_idx.numel())


def segments_from_indices(
    slot_idx: Sequence[int] | torch.Tensor,  # [N] per-row slot, -1 for none; a host list or a CPU tensor
    *,
    device: torch.device | str,
    pad_to: int | None = None,
) -> LoraSegments:
    """Runs of equal consecutive slots (SGMV segments), built on the host (numpy) and copied to `device` once."""
    if isinstance(slot_idx, torch.Tensor):
        # A device tensor would make this wait on the device (nonzero, max); the scheduler has host lists.
        assert slot_idx.device.type == "cpu" and slot_idx.dim() == 1, (slot_idx.device, slot_idx.shape)
        idx = slot_idx.to(torch.int64).numpy()
    else:
        idx = np.asarray(list(slot_idx), dtype=np.int64)
    n = idx.size
    assert n == 0 or int(idx.min()) >= -1, f"slot indices below -1: {int(idx.min())}"
    change = np.flatnonzero(idx[1:] != idx[:-1]) + 1  # [G - 1] first row of every group but the first
    start = np.concatenate([[0], change, [n]]) if n else np.zeros(1, dtype=np.int64)  # [G + 1]
    slot = idx[start[:-1]]  # [G]
    max_len = int(np.diff(start).max()) if n else 0
    if pad_to is not None:
        groups = slot.size
        assert pad_to >= groups, f"pad_to {pad_to} is below the {groups} groups of this batch"
        start = np.concatenate([start, np.full(pad_to - groups, n)])
        slot = np.concatenate([slot, np.full(pad_to - groups, -1)])
        max_len = n
    both = torch.from_numpy(np.concatenate([slot, start]).astype(np.int32)).to(device)  # one copy
    return LoraSegments(slot=both[: slot.size], start=both[slot.size :], max_len=max_len, num_rows=n)


def rows_of(segments: LoraSegments) -> torch.Tensor:
    """[N] slot of every row, the inverse of the builders above (for references and tests)."""
    if segments.start is None:
        return segments.slot.to(torch.int64)
    lengths = (segments.start[1:] - segments.start[:-1]).to(torch.int64)  # [G]
    return torch.repeat_interleave(segments.slot.to(torch.int64), lengths, output_size=segments.num_rows)


@dataclass(frozen=True)
class DecodeLora:
    """The LoRA half of a decode projection for kernels/decode_linear.py: the shrink's t, the slots' B, each row's slot,
    the per-slot rank and scale. Here, beside the row groups, so the engine names it without importing triton."""

    t: torch.Tensor  # [S, M, R] fp32, x A^T at each row's rank (kernels.lora_shrink)
    b_stack: torch.Tensor  # [slots, R, out], rank-major, slices side by side along out
    rank: torch.Tensor  # [slots] int
    scale: torch.Tensor  # [slots] fp32
    slot: torch.Tensor  # [M] int: each row's slot, -1 for none
    slices: tuple[int, ...]  # output width of each fused slice, summing to out


@dataclass(frozen=True)
class LoraDelta:
    """A projection's LoRA delta left for the op that consumes its output to add (kernels/silu_mul.py after gate_up): the
    shrink's t, the slots' B, the rows' groups, per-slot rank and scale.

    The consumer adds scale * t[s, i, :r] @ B[slot_i, :r, cols] to its input tile and rounds the sum to the
    activations' dtype before its own maths, so it computes exactly what kernels.lora_expand then the op would,
    without the delta's pass over the projection's output (engine.lora, "Prefill")."""

    t: torch.Tensor  # [S, N, R] fp32, x A^T at each row's rank (kernels.lora_shrink)
    b_stack: torch.Tensor  # [slots, R, out], rank-major, slices side by side along out
    rank: torch.Tensor  # [slots] int
    scale: torch.Tensor  # [slots] fp32
    segments: LoraSegments  # the rows' groups, as given to the shrink
    slices: tuple[int, ...]  # output width of each fused slice, summing to out


@functools.lru_cache(maxsize=64)
def slice_starts(widths: tuple[int, ...], device: torch.device) -> torch.Tensor:  # [S + 1] int32
    """First column of each fused slice, then the total, on `device`: what the expand and decode_linear read to find a
    column's slice. Built once per (slices, device): a later call, inside a CUDA-graph capture too, copies nothing."""
    starts = [0]
    for w in widths:
        starts.append(starts[-1] + w)
    return torch.tensor(starts, dtype=torch.int32, device=device)


def lora_shrink_ref(
    x: torch.Tensor,  # [N, in]
    a_stack: torch.Tensor,  # [slots, S, R, in], or [slots, R, in] for a single slice
    rank: torch.Tensor,  # [slots] int: each slot's true rank
    segments: LoraSegments,
) -> torch.Tensor:  # [S, N, R] fp32
    """kernels.lora_shrink's op in pure torch and fp32: t[s, i, :r] = x[i] @ A[slot_i, s, :r]^T at r = rank[slot_i], and
    zero wherever the kernel writes nothing (rows of slot -1, columns from a row's rank on). Gathered, no sync (see
    "References" above)."""
    a4 = a_stack if a_stack.dim() == 4 else a_stack.unsqueeze(1)  # [slots, S, R, in]
    slots, num_slices, max_rank, in_features = a4.shape
    n = x.shape[0]
    assert x.shape == (n, in_features), f"x {tuple(x.shape)} does not match a_stack {tuple(a_stack.shape)}"
    assert rank.shape == (slots,) and segments.num_rows == n, (tuple(rank.shape), slots, segments.num_rows, n)
    slot = rows_of(segments).to(x.device)  # [N]
    t = torch.empty(num_slices, n, max_rank, dtype=torch.float32, device=x.device)  # [S, N, R]
    for rows in _row_chunks(n, max_rank * in_features * 4):
        live = _within_rank(slot[rows], rank, max_rank)  # [m, R]
        safe = slot[rows].clamp(min=0)  # rows without an adapter read slot 0, zeroed by `live`
        x_rows = x[rows].float().unsqueeze(-1)  # [m, in, 1]
        for s in range(num_slices):
            h = torch.bmm(a4[:, s][safe].float(), x_rows).squeeze(-1)  # [m, R]
            t[s, rows] = torch.where(live, h, 0.0)
    return t


def lora_expand_ref(
    y: torch.Tensor,  # [N, out], updated in place
    t: torch.Tensor,  # [S, N, R] fp32, from a shrink; entries from a row's rank on are never read
    b_stack: torch.Tensor,  # [slots, R, out]: rank-major, slices side by side along out
    rank: torch.Tensor,  # [slots] int
    scale: torch.Tensor,  # [slots] fp32
    segments: LoraSegments,
    *,
    slices: Sequence[int] | None = None,  # output width of each slice, summing to out; None: one slice
    accumulate: bool = True,  # False: y = the delta, zeros on rows without an adapter
) -> None:
    """kernels.lora_expand's op in pure torch and fp32, y rounded once: y[i] += scale[slot_i] * t[s, i, :r] @
    B[slot_i, :r, slice s] for every slice; rows of slot -1 or an empty slot keep their bits (zeroed when not
    `accumulate`). Gathered, no sync (see "References" above)."""
    n, out_features = y.shape
    slots, max_rank, b_out = b_stack.shape
    widths = tuple(int(w) for w in slices) if slices is not None else (out_features,)
    assert b_out == out_features == sum(widths), f"b_stack {tuple(b_stack.shape)}, y {tuple(y.shape)}, slices {widths}"
    assert t.shape == (len(widths), n, max_rank), (tuple(t.shape), (len(widths), n, max_rank))
    assert rank.shape == scale.shape == (slots,) and segments.num_rows == n, (tuple(rank.shape), tuple(scale.shape), slots)
    slot = rows_of(segments).to(y.device)  # [N]
    for rows in _row_chunks(n, max_rank * out_features * 4):
        live = _within_rank(slot[rows], rank, max_rank)  # [m, R]
        safe = slot[rows].clamp(min=0)
        b = torch.where(live[:, :, None], b_stack[safe].float(), 0.0)  # [m, R, out]; nothing read from a rank on
        delta = torch.empty(b.shape[0], out_features, dtype=torch.float32, device=y.device)  # [m, out]
        col = 0
        for s, w in enumerate(widths):
            h = torch.where(live, t[s, rows], 0.0)  # [m, R]
            delta[:, col : col + w] = torch.bmm(h.unsqueeze(1), b[:, :, col : col + w]).squeeze(1)
            col += w
        delta = delta * scale[safe].float()[:, None]
        adapted = live[:, :1]  # [m, 1]: a slot, of rank 1 or more
        y_rows = y[rows]  # [m, out]
        if accumulate:
            # where(), not y + 0: rows without an adapter keep their exact bits (-0.0 + 0 would turn into +0.0).
            y[rows] = torch.where(adapted, (y_rows.float() + delta).to(y.dtype), y_rows)
        else:
            y[rows] = torch.where(adapted, delta, 0.0).to(y.dtype)


def with_delta_ref(y: torch.Tensor, lora: LoraDelta) -> torch.Tensor:  # [N, out]
    """A copy of y plus each row's LoRA delta, rounded once (lora_expand_ref): the reference of what the ops that take a
    LoraDelta (kernels/silu_mul.py) add to their input first."""
    y = y.clone()
    lora_expand_ref(y, lora.t, lora.b_stack, lora.rank, lora.scale, lora.segments, slices=lora.slices)
    return y


def _within_rank(slot: torch.Tensor, rank: torch.Tensor, max_rank: int) -> torch.Tensor:  # [m, R] bool
    """Which of the R rank columns of each row its adapter has: none for slot -1, the first rank[slot] otherwise."""
    r = torch.where(slot >= 0, rank.to(slot.device)[slot.clamp(min=0)].to(torch.int64), 0)  # [m]
    return torch.arange(max_rank, device=slot.device)[None, :] < r[:, None]


def _row_chunks(n: int, bytes_per_row: int) -> list[slice]:
    """Row ranges whose gathered weights fit in _GATHER_BYTES."""
    per_chunk = max(1, _GATHER_BYTES // max(1, bytes_per_row))
    return [slice(start, min(start + per_chunk, n)) for start in range(0, n, per_chunk)]

