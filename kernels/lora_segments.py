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
class LoraPages:
    """One projection's adapter weights as the multi-LoRA kernels read them: rank rows in pages of a flat pool, found
    through a per-slot page table (S-LoRA's unified paging, Sheng et al., 2023, arXiv:2311.03285).

    Page layout: the page of rank row k of slice s of slot i starts at element `pages[i, s, k]` of `pool` and holds
    that row for every one of `num_layers` layers, A's rows first, then B's (rank-major, `lora_B.T`):

        pool[p + l * in_features : p + (l + 1) * in_features]                      row k of A [r, in] of layer l
        pool[p + L * in_features + l * w_s : p + L * in_features + (l + 1) * w_s]   row k of B.T [r, w_s] of layer l

    so an adapter takes rank[i, s] pages per slice it targets and none for the others (rank 0), whatever the largest
    rank: no padding to max_rank, and a load copies exactly its pages. `layer` picks the layer a launch reads. Entries
    of `pages` from a slot's rank on, and of slices it does not target, are never used to read weights the result
    depends on, but must point inside `pool` (the kernels may load them and mask the products). Example, llama-1b
    (L = 16, in 2048, q 2048, k and v 512 wide), a rank-30 adapter on q and v: 30 pages of 16 x 4096 and 30 of 16 x
    2560 elements, 6.4 MB in bf16, where a max-rank-64 slot over all seven projections held 90 MB.
    """

    pool: torch.Tensor  # [E] flat, the activations' dtype
    pages: torch.Tensor  # [slots, S, R] int64: first element of the page of each rank row (a view: any strides)
    rank: torch.Tensor  # [slots, S] int: rank of each slice of each slot, 0 where it is not targeted
    scale: torch.Tensor  # [slots] fp32
    num_layers: int  # L: layers per page
    layer: int  # the layer this projection is
    in_features: int
    slices: tuple[int, ...]  # output width of each fused slice, summing to out

    @property
    def max_rank(self) -> int:
        return self.pages.shape[2]

    @property
    def num_slots(self) -> int:
        return self.pages.shape[0]

    def a_offset(self) -> int:
        """Element offset of this layer's A row inside a page."""
        return self.layer * self.in_features

    def b_offset(self, s: int) -> int:
        """Element offset of this layer's B.T row of slice s inside a page."""
        return self.num_layers * self.in_features + self.layer * self.slices[s]

    def check(self, device: torch.device) -> None:
        """Assert the layout the kernels assume, once per view and device: the engine's views are made once and launched
        with at every prefill (a dozen tensor attributes read per launch was host time a short prefill's GPU waits for)."""
        if self.__dict__.get("_checked") == device:
            return
        self._check(device)
        object.__setattr__(self, "_checked", device)  # (a frozen dataclass: its fields, not this note, are what is frozen)

    def _check(self, device: torch.device) -> None:
        slots, num_slices, _ = self.pages.shape
        assert self.pool.dim() == 1 and self.pool.stride(0) == 1, (tuple(self.pool.shape), self.pool.stride())
        assert self.pages.dtype == torch.int64 and self.rank.shape == (slots, num_slices) and not self.rank.is_floating_point(), \
            (self.pages.dtype, tuple(self.rank.shape), tuple(self.pages.shape))  # fmt: skip
        assert self.scale.shape == (slots,) and self.scale.dtype == torch.float32, (tuple(self.scale.shape), self.scale.dtype)
        assert len(self.slices) == num_slices and min(self.slices) > 0, (self.slices, num_slices)
        assert 0 <= self.layer < self.num_layers, (self.layer, self.num_layers)
        assert self.pool.device == self.pages.device == self.rank.device == self.scale.device == device, \
            (self.pool.device, self.pages.device, self.rank.device, self.scale.device, device)  # fmt: skip


def pack_pages(
    a_stack: torch.Tensor,  # [slots, S, R, in]
    b_stack: torch.Tensor,  # [slots, R, out]: B transposed, slices side by side along out
    rank: torch.Tensor,  # [slots] or [slots, S] int
    scale: torch.Tensor,  # [slots] fp32
    slices: Sequence[int],
    *,
    generator: torch.Generator | None = None,  # shuffles the pages' order in the pool (tests: the tables are read)
    fill: float = 0.0,  # the value of the one page the table's unused entries point at (tests: NaN)
) -> LoraPages:
    """Dense per-slot stacks laid out as pages (one layer), for tests and benches that build adapters as stacks. Only
    rows below each slice's rank get a page; the table's other entries point at a last page filled with `fill`."""
    slots, num_slices, max_rank, in_features = a_stack.shape
    widths = tuple(int(w) for w in slices)
    rank2 = (rank[:, None].expand(slots, num_slices) if rank.dim() == 1 else rank).to(torch.int32).cpu()  # [slots, S]
    starts = np.cumsum((0,) + widths)
    rows = [(i, s, k) for i in range(slots) for s in range(num_slices) for k in range(int(rank2[i, s]))]
    order = torch.randperm(len(rows), generator=generator).tolist() if generator is not None else list(range(len(rows)))
    sizes = [in_features + widths[s] for _, s, _ in rows]
    pos = [0] * len(rows)
    offset = 0
    for j in order:
        pos[j] = offset
        offset += sizes[j]
    pool = torch.full((offset + in_features + max(widths),), fill, dtype=a_stack.dtype, device=a_stack.device)
    pages = torch.full((slots, num_slices, max_rank), offset, dtype=torch.int64)
    for j, (i, s, k) in enumerate(rows):
        p = pos[j]
        pool[p : p + in_features] = a_stack[i, s, k]
        pool[p + in_features : p + sizes[j]] = b_stack[i, k, starts[s] : starts[s + 1]]
        pages[i, s, k] = p
    dev = a_stack.device
    return LoraPages(pool=pool, pages=pages.to(dev), rank=rank2.to(dev), scale=scale.to(dev), num_layers=1, layer=0,
                     in_features=in_features, slices=widths)  # fmt: skip


def unpack_stacks(w: LoraPages) -> tuple[torch.Tensor, torch.Tensor]:
    """(a_stack [slots, S, R, in], b_stack [slots, R, out]) of this layer, zeros from each slice's rank on: the dense
    form the pages stand for (references and tests)."""
    slots, num_slices, max_rank = w.pages.shape
    live = torch.arange(max_rank, device=w.pages.device)[None, None, :] < w.rank[:, :, None]  # [slots, S, R]
    a = _rows(w.pool, w.pages + w.a_offset(), w.in_features).float() * live[..., None]  # [slots, S, R, in]
    b = [(_rows(w.pool, w.pages[:, s] + w.b_offset(s), wd).float() * live[:, s, :, None]) for s, wd in enumerate(w.slices)]
    return a, torch.cat(b, dim=2)  # [slots, R, out]


def _rows(pool: torch.Tensor, offsets: torch.Tensor, width: int) -> torch.Tensor:  # [*offsets.shape, width]
    """pool[o : o + width] for every offset o, gathered through an overlapping strided view (no index per element)."""
    view = pool.as_strided((pool.numel() - width + 1, width), (1, 1))
    rows = offsets.clamp(0, pool.numel() - width)
    # index_select copies whole rows; indexing the view (`view[rows]`) gathered element by element, 7x slower on a CPU
    # (40 x 64 rows of 256 floats: 11 ms against 1.6 ms), the most of a CPU engine's step on the torch backend
    return view.index_select(0, rows.reshape(-1)).view(*rows.shape, width)


@dataclass(frozen=True)
class DecodeLora:
    """The LoRA half of a decode projection for kernels/decode_linear.py: the shrink's t, the paged weights, each row's
    slot. Here, beside the row groups, so the engine names it without importing triton."""

    t: torch.Tensor  # [S, M, R] fp32, x A^T at each row's rank (kernels.lora_shrink)
    weights: LoraPages
    slot: torch.Tensor  # [M] int: each row's slot, -1 for none

    @property
    def slices(self) -> tuple[int, ...]:
        return self.weights.slices


@dataclass(frozen=True)
class LoraDelta:
    """A projection's LoRA delta left for the op that consumes its output to add (kernels/silu_mul.py after gate_up): the
    shrink's t, the paged weights, the rows' groups.

    The consumer adds scale * t[s, i, :r] @ B[slot_i, :r, cols] to its input tile and rounds the sum to the
    activations' dtype before its own maths, so it computes exactly what kernels.lora_expand then the op would,
    without the delta's pass over the projection's output (engine.lora, "Prefill")."""

    t: torch.Tensor  # [S, N, R] fp32, x A^T at each row's rank (kernels.lora_shrink)
    weights: LoraPages
    segments: LoraSegments  # the rows' groups, as given to the shrink

    @property
    def slices(self) -> tuple[int, ...]:
        return self.weights.slices


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
    weights: LoraPages,
    segments: LoraSegments,
) -> torch.Tensor:  # [S, N, R] fp32
    """kernels.lora_shrink's op in pure torch and fp32: t[s, i, :r] = x[i] @ A[slot_i, s, :r]^T at r = rank[slot_i, s],
    and zero wherever the kernel writes nothing (rows of slot -1, columns from a row's rank on). Gathered through the
    page table, no sync (see "References" above)."""
    w = weights
    slots, num_slices, max_rank = w.pages.shape
    n = x.shape[0]
    assert x.shape == (n, w.in_features), f"x {tuple(x.shape)} does not match in_features {w.in_features}"
    assert segments.num_rows == n, (segments.num_rows, n)
    slot = rows_of(segments).to(x.device)  # [N]
    t = torch.empty(num_slices, n, max_rank, dtype=torch.float32, device=x.device)  # [S, N, R]
    for rows in _row_chunks(n, max_rank * w.in_features * 4):
        safe = slot[rows].clamp(min=0)  # rows without an adapter read slot 0, zeroed by `live`
        x_rows = x[rows].float().unsqueeze(-1)  # [m, in, 1]
        for s in range(num_slices):
            live = _within_rank(slot[rows], w.rank[:, s], max_rank)  # [m, R]
            a = _rows(w.pool, w.pages[safe, s] + w.a_offset(), w.in_features).float()  # [m, R, in]
            h = torch.bmm(a, x_rows).squeeze(-1)  # [m, R]
            t[s, rows] = torch.where(live, h, 0.0)
    return t


def lora_expand_ref(
    y: torch.Tensor,  # [N, out], updated in place
    t: torch.Tensor,  # [S, N, R] fp32, from a shrink; entries from a row's rank on are never read
    weights: LoraPages,
    segments: LoraSegments,
    *,
    accumulate: bool = True,  # False: y = the delta, zeros on rows without an adapter
) -> None:
    """kernels.lora_expand's op in pure torch and fp32, y rounded once: y[i] += scale[slot_i] * t[s, i, :r] @
    B[slot_i, :r, slice s] for every slice at r = rank[slot_i, s]; rows of slot -1 or whose slot targets none of the
    slices keep their bits (zeroed when not `accumulate`). Gathered through the page table, no sync."""
    w = weights
    n, out_features = y.shape
    slots, num_slices, max_rank = w.pages.shape
    assert out_features == sum(w.slices), f"y {tuple(y.shape)} does not match slices {w.slices}"
    assert t.shape == (num_slices, n, max_rank), (tuple(t.shape), (num_slices, n, max_rank))
    assert segments.num_rows == n, (segments.num_rows, n)
    slot = rows_of(segments).to(y.device)  # [N]
    for rows in _row_chunks(n, max_rank * out_features * 4):
        safe = slot[rows].clamp(min=0)
        m = safe.shape[0]
        delta = torch.zeros(m, out_features, dtype=torch.float32, device=y.device)  # [m, out]
        adapted = torch.zeros(m, 1, dtype=torch.bool, device=y.device)  # [m, 1]: a slot with a rank in some slice
        col = 0
        for s, width in enumerate(w.slices):
            live = _within_rank(slot[rows], w.rank[:, s], max_rank)  # [m, R]
            b = _rows(w.pool, w.pages[safe, s] + w.b_offset(s), width).float()  # [m, R, w]
            b = torch.where(live[:, :, None], b, 0.0)  # nothing read from a rank on
            h = torch.where(live, t[s, rows], 0.0)  # [m, R]
            delta[:, col : col + width] = torch.bmm(h.unsqueeze(1), b).squeeze(1)
            # A slice the row's adapter does not target keeps y's bits there (the kernel writes nothing there).
            adapted_s = live[:, :1]
            if accumulate:
                y_rows = y[rows, col : col + width]
                d = delta[:, col : col + width] * w.scale[safe].float()[:, None]
                y[rows, col : col + width] = torch.where(adapted_s, (y_rows.float() + d).to(y.dtype), y_rows)
            adapted |= adapted_s
            col += width
        if not accumulate:
            delta = delta * w.scale[safe].float()[:, None]
            y[rows] = torch.where(adapted, delta, 0.0).to(y.dtype)


def with_delta_ref(y: torch.Tensor, lora: LoraDelta) -> torch.Tensor:  # [N, out]
    """A copy of y plus each row's LoRA delta, rounded once (lora_expand_ref): the reference of what the ops that take a
    LoraDelta (kernels/silu_mul.py) add to their input first."""
    y = y.clone()
    lora_expand_ref(y, lora.t, lora.weights, lora.segments)
    return y


def _within_rank(slot: torch.Tensor, rank: torch.Tensor, max_rank: int) -> torch.Tensor:  # [m, R] bool
    """Which of the R rank columns of each row its adapter has: none for slot -1, the first rank[slot] otherwise."""
    r = torch.where(slot >= 0, rank.to(slot.device)[slot.clamp(min=0)].to(torch.int64), 0)  # [m]
    return torch.arange(max_rank, device=slot.device)[None, :] < r[:, None]


def _row_chunks(n: int, bytes_per_row: int) -> list[slice]:
    """Row ranges whose gathered weights fit in _GATHER_BYTES."""
    per_chunk = max(1, _GATHER_BYTES // max(1, bytes_per_row))
    return [slice(start, min(start + per_chunk, n)) for start in range(0, n, per_chunk)]

