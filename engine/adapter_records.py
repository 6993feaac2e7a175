"""The adapter pool's records (a registered key, an adapter content, a load) and reading an adapter from the store.

Reading (`read_adapter`): the files' bytes (engine.store: confined to the root, size limits), their sha256, validation
against the base (engine.adapters), and the L2 copy in page layout, pinned on CUDA (engine.lora.LoraState.host_copy):
what L3 -> L2 costs, a median 23-28 ms for a 3-7 MB llama-1b adapter on the H200 host (issue 19). None of it touches
the pool's state, so `ReadAhead` runs it on worker threads for the adapters of queued requests (the pool's
`prefetch`), off the engine thread's path; the pool takes the result when the request is admitted.
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from engine.adapter_pages import HostPages, to_pages
from engine.adapter_policy import Heat
from engine.adapters import LoraAdapter, parse_adapter
from engine.api import AdapterError, AdapterInfo
from engine.config import EngineConfig
from engine.model import ModelConfig
from engine.store import adapter_files, content_sha256
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
    heat: Heat = field(default_factory=Heat)


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
    sha, got, us = read_pages(rec.path, rec.sha, model, config.max_adapter_bytes, config.max_lora_rank, fingerprint, lora.dtype)
    return sha, _pinned(lora, got), us


def read_pages(path: Path, want_sha: str | None, model: ModelConfig, max_bytes: int, max_lora_rank: int, fingerprint: str | None,
               dtype: torch.dtype) -> tuple[str, tuple[LoraAdapter, torch.Tensor] | None, int]:  # fmt: skip
    """The CPU work of a read, with nothing of the engine's state: (sha256, (the adapter without its weights, its pages
    in page layout, unpinned) or None when the content is not `want_sha`, µs). Runs in a read process too, so it takes
    and returns only what pickles."""
    t0 = time.perf_counter_ns()
    config_path, weights_path = adapter_files(path, max_bytes)
    config_bytes, weight_bytes = config_path.read_bytes(), weights_path.read_bytes()
    sha = content_sha256(config_bytes, weight_bytes)
    if want_sha is not None and sha != want_sha:
        return sha, None, (time.perf_counter_ns() - t0) // 1000  # the pool reports adapter_changed
    adapter = parse_adapter(config_bytes, weight_bytes, model, max_lora_rank=max_lora_rank, sha256=sha, source=path,
                            base_fingerprint=fingerprint)  # fmt: skip
    data = to_pages(adapter.weights, adapter.target_modules, adapter.rank, model.projection_shapes(), model.num_layers, dtype)
    return sha, (replace(adapter, weights={}), data), (time.perf_counter_ns() - t0) // 1000


def _pinned(lora, got: tuple[LoraAdapter, torch.Tensor] | None) -> HostPages | None:
    return None if got is None else lora.host_pages(*got)


class ReadAhead:
    """Store reads on `threads` worker threads, one future per key (none with threads = 0).

    With `processes`, each thread hands the read's CPU work (`read_pages`: hash, parse, validation, page layout) to a
    pool of that many processes and only waits for it and pins the result: done on the threads themselves, that work is
    Python-bound and held the GIL against the engine thread (issue 19, H200, 2,000 llama-1b adapters, 8 threads: store
    reads p50 86 ms against about 20 ms alone, and decode steps beside them up to 63 ms against 2.6). The processes are
    spawned (never forked from a process holding CUDA) on the first read and touch no device.
    """

    def __init__(self, threads: int, processes: int = 0):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="adapter-read") if threads else None
        self._processes = processes if threads else 0
        self._procs: ProcessPoolExecutor | None = None
        self._futures: dict[str, Future] = {}

    def has_room(self) -> bool:
        return sum(not f.done() for f in self._futures.values()) < self.threads * MAX_AHEAD_PER_THREAD

    def start(self, rec: Record, model: ModelConfig, config: EngineConfig, fingerprint: str | None, lora) -> None:
        assert self._pool is not None and rec.key not in self._futures, rec.key
        if not self._processes:
            self._futures[rec.key] = self._pool.submit(read_adapter, rec, model, config, fingerprint, lora)
            return
        if self._procs is None:
            self._procs = ProcessPoolExecutor(self._processes, mp_context=multiprocessing.get_context("spawn"))
        work = self._procs.submit(read_pages, rec.path, rec.sha, model, config.max_adapter_bytes, config.max_lora_rank, fingerprint,
                                  lora.dtype)  # fmt: skip
        self._futures[rec.key] = self._pool.submit(_pin_when_read, work, lora)

    def pending(self, key: str) -> bool:
        f = self._futures.get(key)
        return f is not None and not f.done()

    def done(self, key: str) -> bool:
        f = self._futures.get(key)
        return f is not None and f.done()

    def take(self, key: str) -> Future | None:
        return self._futures.pop(key, None)


def _pin_when_read(work: Future, lora) -> tuple[str, HostPages | None, int]:
    sha, got, us = work.result()
    t0 = time.perf_counter_ns()
    return sha, _pinned(lora, got), us + (time.perf_counter_ns() - t0) // 1000
