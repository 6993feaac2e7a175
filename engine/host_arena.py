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
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections import deque
from multiprocessing import resource_tracker

import numpy as np
import torch

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux
_PREFIX = "lorabatch-l2-"  # a segment's name: this, the pid of the process that made it, a random token
ALIGN = 256  # bytes: every extent starts on this boundary (DMA-friendly; any dtype's alignment)


class HostArena:
    """`nbytes` of host memory (pinned when `copy_stream` is given: CUDA) handed out as contiguous tensors of `dtype`."""

    def __init__(self, nbytes: int, dtype: torch.dtype, copy_stream: torch.cuda.Stream | None = None, *, shared: bool = False):
        self.dtype = dtype
        self._elem = torch.empty(0, dtype=dtype).element_size()
        self._align = ALIGN // self._elem
        self.capacity = nbytes // ALIGN * ALIGN // self._elem  # elements
        self._stream = copy_stream
        # shared: the block is a named shared-memory segment that other processes (engine.adapter_reader) attach to
        # (`attach`) and write extents of in place; None where it could not be had (then readers send their bytes)
        self.name: str | None = None
        block = _shared_block(self.capacity * self._elem, copy_stream is not None) if shared and self.capacity else None
        if block is not None:
            self._block = block[0].view(dtype)
            self.name = block[1]
            self._finalizer = weakref.finalize(self, *block[2:])
            _SEGMENTS.append(self._finalizer)
        else:
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

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The element offset of `t` in the block, where `t` lies in it (an extent from `alloc`); else None."""
        start = (t.data_ptr() - self._block.data_ptr()) // self._elem
        return start if 0 <= start and start + t.numel() <= self.capacity and t.dtype == self.dtype else None

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


_SEGMENTS: list[weakref.finalize] = []  # this process's shared arenas' finalizers (release_segments)


def release_segments() -> None:
    """Unlink every shared segment this process made, now: for a process that ends without the interpreter's teardown
    (os._exit: engine.engine_process), which would otherwise leave them to the resource tracker's warning."""
    while _SEGMENTS:
        _SEGMENTS.pop()()  # a finalizer already run does nothing


def reap(proc, timeout: float | None = None) -> None:
    """Join a process that may have made shared arenas (`timeout` as join's) and, once it has ended, unlink the segments
    it left. One killed cannot unlink its own, and the resource tracker it shares with the process that spawned it does
    so only when that one exits: each engine process that died under a worker left its arena in /dev/shm, host memory
    of host_cache_bytes and a quarter (80 MB in the drill, 2.5 GiB by default on a GPU), for as long as the worker ran."""
    proc.join(timeout)
    if proc.exitcode is None:  # still running (stuck in a driver call): its segments may still be in use
        return
    try:
        names = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{_PREFIX}{proc.pid}-"))
    except OSError:
        return
    for name in names:
        log.warning("the ended process %d left its L2 arena %s in %s; unlinked", proc.pid, name, SHM_DIR)
        _unlink(name)


def _shared_block(nbytes: int, pin: bool):
    """(uint8 tensor over a new shared-memory segment of `nbytes`, its name, then the finalizer's function and arguments),
    page-locked for DMA when `pin` (cudaHostRegister: about 0.4 ms a MB on the H200 host, against 0.6 for a fresh pinned
    block); None, logged, when the segment or the registration cannot be had. Shared memory that the filesystem behind
    it cannot hold (a container's small /dev/shm) would fault at its first write, so the free space is checked first and
    the segment's room taken when it is made (posix_fallocate), not page by page as it is written.

    The segment is a file of /dev/shm, mapped here and in each reader process (`attach`), and registered with the
    resource tracker the spawned processes share, which unlinks it if this process dies without doing so."""
    name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    try:
        free = os.statvfs(SHM_DIR)
        if free.f_bavail * free.f_frsize < nbytes:
            log.warning("%s has %d bytes free, under the L2 arena's %d: reader processes will send their pages over pipes "
                        "instead; give it more room (docker: --shm-size)", SHM_DIR, free.f_bavail * free.f_frsize, nbytes)  # fmt: skip
            return None
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            resource_tracker.register("/" + name, "shared_memory")
            os.ftruncate(fd, nbytes)
            # Take the room now: ftruncate alone leaves a sparse file whose pages tmpfs finds room for at their first
            # write, and a file made in /dev/shm after the check above (another worker's arena, a neighbour's) can take
            # it first; that write then dies of SIGBUS (a reader process at each read, the engine process at an L2 copy).
            # posix_fallocate takes it or fails with ENOSPC here, where the fallback below is still open.
            os.posix_fallocate(fd, 0, nbytes)
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("no shared memory for the L2 arena (%s): reader processes will send their pages over pipes instead; "
                    "give %s room for %d bytes (docker: --shm-size)", e, SHM_DIR, nbytes)
        _unlink(name)
        return None
    block = _over(mapping)
    if pin:
        err = torch.cuda.cudart().cudaHostRegister(block.data_ptr(), nbytes, 0)
        if int(err) != 0:
            log.warning("cudaHostRegister of the shared L2 arena failed (error %s): a pinned block of its own instead", err)
            _unlink(name)
            return None
    return block, name, _release_shared, name, block.data_ptr() if pin else None


def _release_shared(name: str, registered: int | None) -> None:
    """Unregister the block (CUDA, once the device is done with its copies) and unlink the segment; the mapping goes when
    its last view does."""
    if registered is not None:
        try:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(registered)
        except Exception:  # interpreter shutdown: the driver may be gone already
            pass
    _unlink(name)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return
    try:
        resource_tracker.unregister("/" + name, "shared_memory")
    except Exception:
        pass


def attach(name: str, nbytes: int) -> torch.Tensor:
    """In a reader process: a uint8 tensor over the segment `name` (an arena's `name`), `nbytes` long. The segment stays
    the creating process's to unlink."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return _over(mmap.mmap(fd, nbytes))
    finally:
        os.close(fd)


def _over(mapping: mmap.mmap) -> torch.Tensor:
    """A uint8 tensor over a mapping that keeps it mapped: through numpy, whose array holds an export of the mapping
    (torch.frombuffer holds none: a mapping collected under its tensors crashed a reader process on its first write)."""
    return torch.from_numpy(np.frombuffer(mapping, dtype=np.uint8))
