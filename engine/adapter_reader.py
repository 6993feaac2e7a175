"""Store reads in long-lived reader processes, off the engine process's GIL (issue 19).

A store read (engine.adapter_records `read_adapter`: the files, their sha256, validation, the page layout) is a few
hundred Python and torch calls. On read-ahead threads in the engine's process each call is a turn at the GIL, which
the engine thread waits its turn for: on the H200 host, 8 threads reading made a 250-launch step loop 30x slower (5.8 ms
to 170 ms a step), 2 threads 3x; the 1000- and 2000-adapter cold passes spent most of their time there.

`ReaderPool` starts `n` processes once (spawned: each imports torch once, about 2 s, while the engine warms up) and
keeps them for the engine's life. A read-ahead thread hands one process a path and waits; the process reads, hashes and
validates, and sends the metadata. The thread takes an extent of the L2 arena (engine.host_arena) for the pages and
tells the process its offset; the arena is a shared-memory segment the processes attached to at start, so the process
lays the pages out in place, and the engine process does per read only three small messages and the extent's
bookkeeping. Receiving the pages over the pipe instead (`recv_bytes_into`, as session 9's first version did) cost the
engine process two copies of them under its GIL. Where no shared extent can be had (the arena is full, or /dev/shm
could not hold it), the pages still come over the pipe into a tensor of their own. Errors come back as the AdapterError or OSError
the in-process read raises; a process found dead is replaced and the read tried once more on the new one (then it fails retriably).

The processes stop with the pool (`close`, or when it is garbage collected): each is sent a stop and joined, then
terminated if it has not stopped within a second.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
import weakref
from pathlib import Path

import torch

from engine.adapter_pages import HostPages
from engine.api import AdapterError
from engine.model import LORA_TARGETS

STOP = None  # what a process is sent to end it


def _serve(conn, model, max_adapter_bytes: int, max_lora_rank: int, fingerprint: str | None, shapes, num_layers: int, dtype: str,
           arena: tuple[str, int] | None) -> None:  # fmt: skip
    """A reader process's loop: (path, registered sha) in, ("ok", ...) out, or an error; then, told where, the pages
    written into the shared L2 arena (("at", offset) in, ("written", µs) out) or sent as bytes (("pipe",) in)."""
    torch.set_num_threads(1)
    from engine.adapter_pages import page_elems_of, to_pages, write_pages
    from engine.adapter_records import read_validated
    from engine.host_arena import attach

    pool_dtype = getattr(torch, dtype)
    block = attach(*arena).view(pool_dtype) if arena is not None else None
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is STOP:
            return
        path, registered = msg
        t0 = time.perf_counter_ns()
        try:
            sha, ad = read_validated(Path(path), registered, model, max_adapter_bytes, max_lora_rank, fingerprint)
            if ad is None:
                conn.send(("changed", sha, (time.perf_counter_ns() - t0) // 1000))
                continue
            numel = page_elems_of(ad.target_modules, ad.rank, shapes, num_layers)
        except AdapterError as e:
            conn.send(("adapter_error", str(e), e.code, e.retriable))
            continue
        except OSError as e:
            conn.send(("os_error", f"{type(e).__name__}: {e}"))
            continue
        except Exception as e:  # anything else a malformed file provokes: refused, and the process goes on
            conn.send(("adapter_error", f"{path}: cannot be read ({type(e).__name__}: {e})", "adapter_invalid", False))
            continue
        meta = (sha, ad.rank, ad.alpha, ad.use_rslora, ad.scaling, ad.target_modules, numel)
        conn.send(("ok", meta, (time.perf_counter_ns() - t0) // 1000))
        try:
            where = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if where[0] == "at" and block is not None:
                write_pages(block[where[1] : where[1] + numel], ad.weights, ad.target_modules, ad.rank, shapes, num_layers)
                conn.send(("written", (time.perf_counter_ns() - t0) // 1000))
                continue
            data = to_pages(ad.weights, ad.target_modules, ad.rank, shapes, num_layers, pool_dtype)
        except Exception as e:  # a bug, not the file: the read fails retriably and the process goes on
            conn.send(("adapter_error", f"{path}: the page layout failed ({type(e).__name__}: {e})", "adapter_load_failed", True))
            continue
        conn.send_bytes(data.view(torch.uint8).numpy())


class ReaderPool:
    """`n` reader processes (module docstring); `read` is called from read-ahead threads, at most `n` at once."""

    def __init__(self, n: int, model, config, fingerprint: str | None, lora):
        self._ctx = mp.get_context("spawn")
        self._arena = lora.arena if lora.arena is not None and lora.arena.name is not None else None  # shared: written in place
        shared = (self._arena.name, self._arena.nbytes) if self._arena is not None else None
        self._args = (model, config.max_adapter_bytes, config.max_lora_rank, fingerprint, dict(lora.shapes), lora.num_layers,
                      str(lora.dtype).removeprefix("torch."), shared)  # fmt: skip
        self._host_tensor = lora.host_tensor  # an extent of the L2 arena, or a pinned tensor of its own
        self._page_elems = lora.page_elems
        self._idle: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._workers: list = []
        self._closed = False
        self.written_in_place = self.sent_over_pipe = 0  # reads by where their pages went
        for _ in range(n):
            self._idle.put(self._start())
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def _start(self):
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_serve, args=(child, *self._args), daemon=True, name="adapter-reader")
        proc.start()
        child.close()
        worker = (proc, parent)
        with self._lock:
            self._workers.append(worker)
        return worker

    def read(self, path: Path, registered: str | None) -> tuple[str, HostPages | None, int]:
        """(sha256, L2 copy or None when the content is not the registered one, µs of the read in the process), as
        engine.adapter_records `read_adapter` returns them; raises AdapterError or OSError as it does."""
        for attempt in (1, 2):  # a process found dead is replaced and the read tried once more on the new one
            worker = self._idle.get()
            proc, conn = worker
            try:
                conn.send((str(path), registered))
                reply = conn.recv()
                if reply[0] == "ok":
                    (sha, rank, alpha, rslora, scaling, targets, numel), us = reply[1], reply[2]
                    data = self._host_tensor(numel)
                    start = self._arena.offset_of(data) if self._arena is not None else None
                    if start is not None:  # the process writes the pages in place: this process only waits
                        conn.send(("at", start))
                        done = conn.recv()
                        if done[0] == "written":
                            us = done[1]
                            self.written_in_place += 1
                        else:
                            reply = done
                    else:  # no shared extent free (or no shared arena): the pages come over the pipe
                        conn.send(("pipe",))
                        got = conn.recv_bytes_into(data.view(torch.uint8).numpy())
                        assert got == numel * data.element_size(), (got, numel)
                        self.sent_over_pipe += 1
                break
            except (EOFError, OSError) as e:
                with self._lock:
                    if worker in self._workers:
                        self._workers.remove(worker)
                proc.kill()
                conn.close()
                if self._closed:
                    raise OSError(f"the adapter readers were stopped while reading {path}; read again") from e
                worker = self._start()
                if attempt == 2:
                    raise OSError(f"the adapter reader process stopped while reading {path} ({type(e).__name__}); read again") from e
            finally:
                self._idle.put(worker)
        if reply[0] == "changed":
            return reply[1], None, reply[2]
        if reply[0] == "adapter_error":
            raise AdapterError(reply[1], code=reply[2], retriable=reply[3])
        if reply[0] == "os_error":
            raise OSError(reply[1])
        modules = tuple(LORA_TARGETS.index(m) for m in targets)
        host = HostPages(sha256=sha, rank=rank, scaling=scaling, alpha=alpha, use_rslora=rslora, target_modules=targets,
                         modules=modules, data=data, page_elems=tuple(self._page_elems[m] for m in modules))  # fmt: skip
        return sha, host, us

    def close(self) -> None:
        self._closed = True
        self._finalizer()


def _stop_all(workers: list) -> None:
    for proc, conn in list(workers):
        try:
            conn.send(STOP)
        except (OSError, ValueError):
            pass
    for proc, conn in list(workers):
        proc.join(timeout=1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=1.0)
        conn.close()
    workers.clear()
