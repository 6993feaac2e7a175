"""The adapter pool's records (a registered key, an adapter content, a load) and reading an adapter from the store.

Reading (`read_adapter`): the files' bytes (engine.store: confined to the root, size limits), their sha256, validation
against the base (engine.adapters), and the L2 copy in page layout, pinned on CUDA (engine.lora.LoraState.host_copy):
what L3 -> L2 costs, about 12 ms for a 3-13 MB llama-1b adapter on one core of the H200 host (read 2, sha256 4, parse 2-4,
page layout 2-4; pinning a fresh block 4.7 ms more). The sha256 of a registered adapter's bytes runs on a hashing
thread beside their validation (so a read keeps a second core busy for its hash's few ms) (hashlib lets go of the GIL), the two compared after: on this project's 2-core CI host
a rank-16 llama-1b read took 3.9-4.1 ms against 4.8-5.4 hashed first, rank 64 13.4-14.1 against 16.1
(`lorabatch bench reads`, two runs). None of it touches the pool's state, so `ReadAhead` runs it on
worker threads for the adapters of queued requests (the pool's `read_ahead` and `prefetch`), off the engine thread's
path, or hands it to reader processes (engine.adapter_reader) so that it does not hold the engine process's GIL either;
the pool takes the result when the request is admitted.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine.adapter_pages import HostPages
from engine.adapter_policy import Heat
from engine.adapters import LoraAdapter, parse_adapter
from engine.api import AdapterError, AdapterInfo
from engine.config import EngineConfig
from engine.model import ModelConfig
from engine.sizing import AUTO_READERS
from engine.store import adapter_files, content_sha256, read_file
from engine.timing import Stopwatch

MAX_AHEAD_PER_THREAD = 4  # reads queued or running per thread at most: prefetch goes no further ahead than that


@dataclass
class Record:
    """One registered key."""

    key: str
    path: Path
    sha: str | None  # as registered, or as first read
    tenant: str
    slo_tier: str
    error: AdapterError | None = None
    error_files: tuple | None = None  # files_stamp(path) when `error` came from the files: read again once it differs
    heat: Heat = field(default_factory=Heat)


def files_stamp(path: Path) -> tuple:
    """(inode, size, mtime in ns) of each file in the folder `path`, by name; () where it cannot be listed (gone). Putting
    files back (a copy, a rename into place) changes it."""
    try:
        return tuple(sorted((f.name, f.inode(), f.stat().st_size, f.stat().st_mtime_ns) for f in os.scandir(path)))
    except OSError:
        return ()


@dataclass(frozen=True)
class Meta:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    nbytes: int  # in the slots' dtype


@dataclass
class Content:
    """One adapter content (sha256), under one or more keys."""

    sha: str
    meta: Meta
    host: HostPages | None = None  # L2 copy (or a transient one waiting for a slot); None: only in L1 or L3
    keys: set[str] = field(default_factory=set)
    slot: int | None = None
    pages: list[tuple[int, list[int]]] | None = None  # (page size, offsets in the pool) per module, while resident
    pins: int = 0
    last_used: float = 0.0
    uncharged: list[LoadEvent] = field(default_factory=list)  # loads no request has been charged yet
    warm: bool = False  # brought in by the warm pool and not used since


@dataclass
class LoadEvent:
    key: str
    sha: str
    tier: str
    dest: str
    reason: str
    tenant: str
    meta: Meta | None
    read_us: int = 0
    copy: Stopwatch | None = None
    error_code: str | None = None
    skip_reason: str | None = None

    def load_us(self) -> int:
        return self.read_us + (self.copy.elapsed_us() if self.copy is not None else 0)

    def info(self) -> AdapterInfo:
        m = self.meta or Meta(0, 0.0, False, (), 0)
        return AdapterInfo(
            key=self.key, sha256=self.sha, rank=m.rank, alpha=m.alpha, use_rslora=m.use_rslora,
            target_modules=m.target_modules, nbytes=m.nbytes, load_us=self.load_us(), tier=self.tier, dest=self.dest,
            reason=self.reason, tenant=self.tenant, error_code=self.error_code, skip_reason=self.skip_reason,
        )  # fmt: skip


def read_adapter(rec: Record, model: ModelConfig, config: EngineConfig, fingerprint: str | None, lora) -> tuple[str, HostPages | None, int]:
    """(sha256, L2 copy or None when the content is not the registered one, µs) of `rec`'s folder; raises OSError or
    AdapterError as the files do."""
    t0 = time.perf_counter_ns()
    sha, adapter = read_validated(rec.path, rec.sha, model, config.max_adapter_bytes, config.max_lora_rank, fingerprint)
    host = lora.host_copy(adapter) if adapter is not None else None
    return sha, host, (time.perf_counter_ns() - t0) // 1000


def read_validated(path: Path, registered: str | None, model: ModelConfig, max_adapter_bytes: int, max_lora_rank: int,
                   fingerprint: str | None) -> tuple[str, LoraAdapter | None]:  # fmt: skip
    """(sha256, the validated adapter, or None when its content is not the `registered` sha256) of the folder at `path`:
    what a store read does before the page layout, in the engine's process or a reader process (engine.adapter_reader)."""
    config_path, weights_path = adapter_files(path, max_adapter_bytes)
    config_bytes = bytes(read_file(config_path, max_adapter_bytes))
    weight_bytes = read_file(weights_path, max_adapter_bytes - len(config_bytes))  # the limit is on both files together
    if registered is None or len(weight_bytes) < OVERLAP_HASH_BYTES:
        return read_validated_serial(path, config_bytes, weight_bytes, registered, model, max_lora_rank, fingerprint)
    # The registered content is expected: hash on a thread of its own (hashlib lets go of the GIL over the bytes) while
    # this one validates them as that content (parse_adapter only reads the buffer), then compare. A changed file is
    # reported as changed even where it would not parse: the comparison comes before the parse's error.
    try:
        hashing = _hash_pool().submit(content_sha256, config_bytes, weight_bytes)
    except RuntimeError:  # the interpreter is shutting down: no new threads; hash here, first
        return read_validated_serial(path, config_bytes, weight_bytes, registered, model, max_lora_rank, fingerprint)
    try:
        adapter = parse_adapter(config_bytes, weight_bytes, model, max_lora_rank=max_lora_rank, sha256=registered, source=path,
                                base_fingerprint=fingerprint)  # fmt: skip
    except Exception:  # not an interrupt: those go up as they came
        if hashing.result() != registered:
            return hashing.result(), None
        raise
    sha = hashing.result()
    return (sha, adapter) if sha == registered else (sha, None)


def read_validated_serial(path: Path, config_bytes: bytes, weight_bytes: bytearray, registered: str | None, model: ModelConfig,
                          max_lora_rank: int, fingerprint: str | None) -> tuple[str, LoraAdapter | None]:  # fmt: skip
    """`read_validated` on bytes already read, the sha256 first: what reads of unregistered or small adapters do."""
    sha = content_sha256(config_bytes, weight_bytes)
    if registered is not None and sha != registered:
        return sha, None  # the pool reports adapter_changed
    return sha, parse_adapter(config_bytes, weight_bytes, model, max_lora_rank=max_lora_rank, sha256=sha, source=path,
                              base_fingerprint=fingerprint)  # fmt: skip


OVERLAP_HASH_BYTES = 1 << 20  # weights at least this big are hashed beside their validation (smaller: a thread's hand-off costs more)
_hashers: ThreadPoolExecutor | None = None
_hashers_lock = threading.Lock()


def _hash_pool() -> ThreadPoolExecutor:
    """This process's hashing threads (created on first use, so a reader process gets its own): one per concurrent read
    of the most a host's readers run (engine.sizing.AUTO_READERS)."""
    global _hashers
    with _hashers_lock:
        if _hashers is None:
            _hashers = ThreadPoolExecutor(max_workers=AUTO_READERS, thread_name_prefix="adapter-hash")
        return _hashers


def _forget_hash_pool() -> None:
    """In a forked child: the parent's pool came over without its threads, so a task given to it would never run."""
    global _hashers, _hashers_lock
    _hashers, _hashers_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_hash_pool)


def _timed(began: list[float], fn: Callable, *args):
    began[0] = time.perf_counter()
    return fn(*args)


class ReadAhead:
    """Store reads on `threads` worker threads, one future per key (none with threads = 0); with a `reader`
    (engine.adapter_reader.ReaderPool) the threads hand each read to a reader process and wait for its pages."""

    def __init__(self, threads: int, reader=None):
        self.threads = threads
        self.reader = reader
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="adapter-read") if threads else None
        self._futures: dict[str, Future] = {}
        self._running = 0  # futures not done yet (started here, counted down by their done callbacks)
        self._lock = threading.Lock()
        self.spans: deque[tuple[float, float]] = deque(maxlen=4096)  # (perf_counter when it began, landed) of recent reads

    def has_room(self) -> bool:
        return self._running < self.threads * MAX_AHEAD_PER_THREAD

    @property
    def in_flight(self) -> int:
        """Reads queued or running."""
        return self._running

    @property
    def landed(self) -> int:
        """Reads finished and not yet taken."""
        return sum(f.done() for f in self._futures.values())

    def start(self, rec: Record, *args) -> None:
        assert self._pool is not None and rec.key not in self._futures, rec.key
        with self._lock:
            self._running += 1
        began = [0.0]  # set by the thread when the read begins (it may queue behind others first)
        if self.reader is not None:
            future = self._pool.submit(_timed, began, self.reader.read, rec.path, rec.sha)
        else:
            future = self._pool.submit(_timed, began, read_adapter, rec, *args)
        future.add_done_callback(lambda f: self._ended(began[0]))
        self._futures[rec.key] = future

    def _ended(self, began: float) -> None:
        if began:  # (0: cancelled before it began)
            self.spans.append((began, time.perf_counter()))
        with self._lock:
            self._running -= 1

    def pending(self, key: str) -> bool:
        f = self._futures.get(key)
        return f is not None and not f.done()

    def done(self, key: str) -> bool:
        f = self._futures.get(key)
        return f is not None and f.done()

    def take(self, key: str) -> Future | None:
        return self._futures.pop(key, None)
