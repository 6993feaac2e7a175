"""L2's host memory: one block, page-locked once at start, cut into the extents adapters' L2 copies live in (issue 19).

Each store read used to take a fresh pinned tensor for its L2 copy. On the H200 host a fresh pinned block costs
`cudaHostAlloc` about 0.6 ms a MB (4.7 ms for a 6.4 MB llama-1b adapter, 589 ms for 1 GB), and that call serializes
with the engine thread's CUDA calls; the 2000-adapter cold pass made 809 of them. `HostArena` takes the memory once, when
the engine starts (the host cache's bytes and a quarter more for reads in flight and copies on their way to L1), and
hands out contiguous extents of it, first fit, lowest address first; freed extents merge with their free neighbours.
torch's own caching of pinned blocks rounds each up to a power of two and never splits one; this does neither.

An extent is one adapter's L2 copy in page layout (engine.adapter_pages `HostPages.data`): a view of the block, given
back when that view is garbage collected (its last holder, L2 or a load in flight, let go of it), from whatever
thread. A DMA from it may still be running then (a copy to L1 is queued on the side stream, and L2 may drop its copy
right after): on CUDA a freed extent is reused only after an event recorded on the side stream, behind every copy
issued before the free, has completed. When no extent fits, `alloc` returns None and the caller takes a tensor of its
own, as before (counted in `misses`).
"""

from __future__ import annotations

import bisect
import threading
import weakref
from collections import deque

import torch

ALIGN = 256  # bytes: every extent starts on this boundary (DMA-friendly; any dtype's alignment)


class HostArena:
    """`nbytes` of host memory (pinned when `copy_stream` is given: CUDA) handed out as contiguous tensors of `dtype`."""

    def __init__(self, nbytes: int, dtype: torch.dtype, copy_stream: torch.cuda.Stream | None = None):
        self.dtype = dtype
        self._elem = torch.empty(0, dtype=dtype).element_size()
        self._align = ALIGN // self._elem
        self.capacity = nbytes // ALIGN * ALIGN // self._elem  # elements
        self._stream = copy_stream
        self._block = torch.empty(self.capacity, dtype=dtype, pin_memory=copy_stream is not None)
        self._lock = threading.Lock()
        self._starts: list[int] = [0] if self.capacity else []  # free extents, sorted by start (elements)
        self._sizes: dict[int, int] = {0: self.capacity} if self.capacity else {}
        self._released: deque[tuple[int, int]] = deque()  # given back by finalizers (append: atomic), not yet fenced
        self._fenced: list[tuple[object, list[tuple[int, int]]]] = []  # (event or None, extents) awaiting the side stream
        self.used = 0  # elements handed out and not yet back
        self.misses = 0  # allocs that found no extent

    @property
    def nbytes(self) -> int:
        return self.capacity * self._elem

    def alloc(self, numel: int) -> torch.Tensor | None:
        """A tensor of `numel` elements inside the block, or None when no free extent holds it."""
        size = -(-max(numel, 1) // self._align) * self._align
        with self._lock:
            self._reclaim()
            for i, start in enumerate(self._starts):
                free = self._sizes[start]
                if free >= size:
                    del self._starts[i], self._sizes[start]
                    if free > size:
                        bisect.insort(self._starts, start + size)
                        self._sizes[start + size] = free - size
                    self.used += size
                    break
            else:
                self.misses += 1
                return None
        view = self._block[start : start + numel]
        weakref.finalize(view, self._released.append, (start, size))  # from whatever thread lets go of it last
        return view

    def _reclaim(self) -> None:
        """Fence what was released since the last call behind the side stream's work so far, and take back what was fenced
        and whose event has completed (under the lock)."""
        batch = []
        while self._released:
            batch.append(self._released.popleft())
        if batch:
            event = None
            if self._stream is not None:
                event = torch.cuda.Event()
                event.record(self._stream)
            self._fenced.append((event, batch))
        while self._fenced and (self._fenced[0][0] is None or self._fenced[0][0].query()):
            _, batch = self._fenced.pop(0)
            for start, size in batch:
                self._free(start, size)

    def _free(self, start: int, size: int) -> None:
        self.used -= size
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and start + size == self._starts[i]:  # merge with the next free extent
            nxt = self._starts.pop(i)
            size += self._sizes.pop(nxt)
        if i > 0 and self._starts[i - 1] + self._sizes[self._starts[i - 1]] == start:  # and with the previous one
            self._sizes[self._starts[i - 1]] += size
            return
        self._starts.insert(i, start)
        self._sizes[start] = size

    def free_elems(self) -> int:
        """Elements in free extents now (after taking back what the side stream is done with)."""
        with self._lock:
            self._reclaim()
            return sum(self._sizes.values())
