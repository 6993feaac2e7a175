"""Paged adapter memory: the page layout of an adapter, and the allocator of pages in the device pool (L1).

S-LoRA's unified paging (Sheng et al., 2023, arXiv:2311.03285), in the layout the kernels read
(kernels.lora_segments.LoraPages): a page holds one rank row of one adapter projection (q, k, ..., down) for every
layer, A's rows first, then B's (`lora_B.T`):

    page of (adapter, module m, rank row k) = [A_0[k] | A_1[k] | ... | A_{L-1}[k] | B_0.T[k] | ... | B_{L-1}.T[k]]
    L x (in_m + out_m) elements

So an adapter takes rank pages per module it targets, and nothing for the modules it does not: at llama-1b (16
layers, hidden 2048, KV 512, MLP 8192) a q page is 16 x 4096 x 2 B = 128 KB, a k or v page 80 KB, an MLP page 320 KB;
a rank-30 q,v adapter is 30 x (128 + 80) KB = 6.4 MB, where a max-rank-64 slot over all seven projections was 90 MB.

Pages of one module all have one size; the pool (one flat tensor, `capacity` elements) is cut into equal chunks, and
a chunk, when first needed, is given to one page size and cut into pages of it; a chunk whose pages are all free
again goes back to the free chunks, for any size. The chunk is the least common multiple of the page sizes where
that is at most MAX_CHUNK_PAGES of the largest (llama-1b: lcm(128, 80, 320) KB = 640 KB, taken 13 times to reach
MIN_CHUNK_ELEMS; llama-8b: 22.5 MB, 20 MLP pages), so no element of a chunk is wasted; otherwise MAX_CHUNK_PAGES of the largest, wasting less than a page per
chunk. The bookkeeping is host lists: no device allocation or copy on the hot path.

Loads (L2 -> L1): the host copy (`HostPages`, pinned) is already in page layout, module by module, rank row by rank
row, and pages of a module are handed out lowest offset first, so a fresh adapter's pages of one module are mostly
consecutive in the pool: `copy_runs` merges consecutive pages into one copy each, and a load is a few DMAs of
exactly the adapter's bytes, with no zero-fill (rows past a rank and untargeted modules are never read: their rank
is 0 in the page table).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

MAX_CHUNK_PAGES = 64  # a chunk is at most this many of the largest page (module docstring)
MIN_CHUNK_ELEMS = 1 << 22  # and at least this many elements (8 MB in bf16), in whole lcms: fewer chunks to track
MIN_CHUNKS = 16  # per page size, at least, or the chunks are made smaller


@dataclass(frozen=True)
class HostPages:
    """An adapter's L2 copy: its pages in page layout, contiguous in one (pinned, on CUDA) tensor."""

    sha256: str
    rank: int
    scaling: float
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # in LORA_TARGETS order
    modules: tuple[int, ...]  # indices into LORA_TARGETS of the modules it targets, in that order
    data: torch.Tensor  # [rank x sum of its modules' page sizes] flat, the pool's dtype
    page_elems: tuple[int, ...]  # page size of each of `modules`

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def module_start(self, i: int) -> int:
        """Element offset in `data` of the first page of modules[i]."""
        return self.rank * sum(self.page_elems[:i])


def page_elems_of(targets: tuple[str, ...], rank: int, shapes: dict[str, tuple[int, int]], num_layers: int) -> int:
    """Elements of an adapter's pages: rank x page size over the modules it targets."""
    return rank * num_layers * sum(sum(shapes[m]) for m in targets)


def write_pages(dest: torch.Tensor, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], targets: tuple[str, ...],
                rank: int, shapes: dict[str, tuple[int, int]], num_layers: int) -> None:  # fmt: skip
    """Lay an adapter's weights out in `dest` (flat, `page_elems_of` elements): each targeted module's pages, rank row by
    rank row (module docstring), converted to dest's dtype. A layer the adapter leaves out of a module it targets gets
    zero rows there (PEFT's layers_to_transform). A copy per layer and matrix straight into place: half the time of
    stacking the layers and concatenating (0.56 against 1.06 ms for a rank-32 q on the CPU), and no second buffer."""
    start = 0
    for module in targets:
        in_f, out_f = shapes[module]
        pages = dest[start : start + rank * num_layers * (in_f + out_f)].view(rank, num_layers * (in_f + out_f))
        a_rows = pages[:, : num_layers * in_f].view(rank, num_layers, in_f)  # every layer's A rows, then every layer's B.T's
        b_rows = pages[:, num_layers * in_f :].view(rank, num_layers, out_f)
        for layer in range(num_layers):
            ab = weights.get((layer, module))
            if ab is None:
                a_rows[:, layer].zero_()
                b_rows[:, layer].zero_()
                continue
            a_rows[:, layer].copy_(ab[0])  # lora_A [r, in]
            b_rows[:, layer].copy_(ab[1].t())  # lora_B [out, r], as B.T [r, out]
        start += rank * num_layers * (in_f + out_f)
    assert start == dest.numel(), (start, dest.numel())


def to_pages(weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], targets: tuple[str, ...], rank: int,
             shapes: dict[str, tuple[int, int]], num_layers: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:  # fmt: skip
    """[sum over targets of rank x page size] flat, in `dtype`, page-locked when `pin` (write_pages)."""
    dest = torch.empty(page_elems_of(targets, rank, shapes, num_layers), dtype=dtype, pin_memory=pin)
    write_pages(dest, weights, targets, rank, shapes, num_layers)
    return dest


def copy_runs(host: HostPages, pages: list[list[int]]) -> list[tuple[int, int, int]]:
    """(host offset, pool offset, elements) of the copies that write `host` into its pages: consecutive pages merged."""
    runs: list[tuple[int, int, int]] = []
    for i, offsets in enumerate(pages):
        size, start = host.page_elems[i], host.module_start(i)
        for k, dest in enumerate(offsets):
            src = start + k * size
            if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dest:
                h, d, n = runs[-1]
                runs[-1] = (h, d, n + size)
            else:
                runs.append((src, dest, size))
    return runs


class PageAllocator:
    """Pages of a few fixed sizes in one flat arena of `capacity` elements, through equal chunks (module docstring)."""

    def __init__(self, capacity: int, page_sizes: tuple[int, ...]):
        sizes = sorted(set(page_sizes))
        assert sizes and sizes[0] > 0, page_sizes
        largest = sizes[-1]
        lcm = math.lcm(*sizes)
        unit = lcm if lcm <= MAX_CHUNK_PAGES * largest else MAX_CHUNK_PAGES * largest
        chunk = unit * max(1, min(MIN_CHUNK_ELEMS // unit, capacity // (unit * MIN_CHUNKS * len(sizes))))
        while chunk > largest and capacity // chunk < MIN_CHUNKS * len(sizes):
            chunk = max(largest, chunk // 2)  # a small pool (tests): smaller chunks, at some waste, so every size gets some
        assert capacity >= chunk, f"a pool of {capacity} elements holds no page of {largest}"
        self.chunk = chunk
        self.num_chunks = capacity // chunk
        self.capacity = self.num_chunks * chunk
        self.per_chunk = {s: chunk // s for s in sizes}
        self._free_chunks = list(range(self.num_chunks - 1, -1, -1))  # popped from the end: lowest first
        self._free: dict[int, dict[int, list[int]]] = {s: {} for s in sizes}  # size -> chunk -> free offsets, descending
        self.nfree = {s: 0 for s in sizes}  # free pages in the chunks of each size
        self.used: dict[int, int] = {}  # chunk -> pages in use
        self._size_of: dict[int, int] = {}  # chunk -> its page size

    @classmethod
    def holding(cls, need: dict[int, int]) -> PageAllocator:
        """The smallest pool (in whole chunks) that holds `need` (page size -> count) at once."""
        capacity = sum(size * n for size, n in need.items())
        while True:
            alloc = cls(capacity, tuple(need))
            if alloc.could_fit(list(need.items())):
                return alloc
            capacity = max(capacity + alloc.chunk, _chunks_short(need, {s: 0 for s in need}, alloc.per_chunk) * alloc.chunk)

    @property
    def free_chunks(self) -> int:
        return len(self._free_chunks)

    def fits(self, need: dict[int, int]) -> bool:
        """Whether `need` (page size -> count) can be allocated now, all of it."""
        return _chunks_short(need, self.nfree, self.per_chunk) <= len(self._free_chunks)

    def could_fit(self, need: list[tuple[int, int]]) -> bool:
        """Whether `need` would fit in the empty pool (else it never will)."""
        total: dict[int, int] = {}
        for size, n in need:
            total[size] = total.get(size, 0) + n
        return _chunks_short(total, {s: 0 for s in self.nfree}, self.per_chunk) <= self.num_chunks

    def alloc(self, need: list[tuple[int, int]]) -> list[list[int]] | None:
        """For each (page size, count) of `need`, that many page offsets (lowest first); None, and nothing taken,
        if it does not all fit."""
        total: dict[int, int] = {}
        for size, n in need:
            total[size] = total.get(size, 0) + n
        if not self.fits(total):
            return None
        return [self._take(size, n) for size, n in need]

    def free(self, size: int, offsets: list[int]) -> None:
        by_chunk: dict[int, list[int]] = {}
        for off in offsets:
            c = off // self.chunk
            assert self._size_of.get(c) == size and (off - c * self.chunk) % size == 0, (off, size, self._size_of.get(c))
            by_chunk.setdefault(c, []).append(off)
        for c, offs in by_chunk.items():
            self.nfree[size] += len(offs)
            self.used[c] -= len(offs)
            if self.used[c] == 0:  # the whole chunk is free again: back to the free chunks, for any size
                self._free[size].pop(c, None)
                del self.used[c], self._size_of[c]
                self.nfree[size] -= self.per_chunk[size]
                self._free_chunks.append(c)
                self._free_chunks.sort(reverse=True)
            else:
                free = self._free[size].setdefault(c, [])
                free.extend(offs)
                free.sort(reverse=True)

    def trial(self) -> Trial:
        """A what-if of frees, for choosing victims before evicting any."""
        return Trial(self)

    def used_elems(self) -> int:
        return sum(n * self._size_of[c] for c, n in self.used.items())

    def _take(self, size: int, n: int) -> list[int]:
        """`n` free pages of `size`, lowest first: from the lowest chunk with free pages of it (so an adapter's pages
        stay together), then the next, cutting a free chunk into pages of `size` when none is left."""
        chunks = self._free[size]
        taken: list[int] = []
        while len(taken) < n:
            if not chunks:
                c = self._free_chunks.pop()
                base = c * self.chunk
                chunks[c] = [base + i * size for i in range(self.per_chunk[size] - 1, -1, -1)]
                self.used[c], self._size_of[c] = 0, size
                self.nfree[size] += self.per_chunk[size]
            c = min(chunks)
            free = chunks[c]  # descending: the lowest offsets at its end
            k = min(n - len(taken), len(free))
            taken.extend(reversed(free[-k:]))
            del free[-k:]
            if not free:
                del chunks[c]
            self.used[c] += k
            self.nfree[size] -= k
        return taken


class Trial:
    """Counts of a PageAllocator after some frees, without making them."""

    def __init__(self, alloc: PageAllocator):
        self._a = alloc
        self._used: dict[int, int] = {}
        self._nfree = dict(alloc.nfree)
        self._free_chunks = alloc.free_chunks

    def free(self, size: int, offsets: list[int]) -> None:
        chunk = self._a.chunk
        for c, n in Counter(off // chunk for off in offsets).items():
            used = self._used.get(c, self._a.used[c]) - n
            self._used[c] = used
            self._nfree[size] += n
            if used == 0:
                self._free_chunks += 1
                self._nfree[size] -= self._a.per_chunk[size]

    def fits(self, need: dict[int, int]) -> bool:
        return _chunks_short(need, self._nfree, self._a.per_chunk) <= self._free_chunks


def _chunks_short(need: dict[int, int], nfree: dict[int, int], per_chunk: dict[int, int]) -> int:
    """Free chunks `need` takes beyond the free pages of each size's own chunks."""
    return sum(-(-(n - nfree[size]) // per_chunk[size]) for size, n in need.items() if n > nfree[size])
