"""The adapter pool: which adapters are registered, where each one's weights are, and loading them.

Tiers:
- L1, paged device memory (`engine.lora.LoraState`, engine/adapter_pages.py): a pool of `adapter_gpu_bytes` in pages
  of one rank row of one module, an adapter taking exactly its rank over the modules it targets, and a slot (one of
  `max_loras` page-table rows) naming it in a batch. Adapters of running requests are pinned; room is made by keep
  score (engine/adapter_residency.py).
- L2, host memory (pinned on CUDA, in page layout, so a load is a few DMAs of exactly its bytes on a side stream,
  `LoraState.write`): an LRU bounded by `host_cache_bytes`.
- L3, the adapter's folder as registered (the consumer registers `AdapterStore.path(sha256)`). Every read re-hashes
  the files; content that differs from the sha256 the key was registered with, or first read as, is refused
  (`adapter_changed`): a key never silently changes weights, so neither KV nor slots can go stale under it. Reads
  for queued requests run ahead on threads (`prefetch`, engine/adapter_records.py). With threads, the engine thread
  never reads the store (but for the operator's eager `load`): an admission, a placement or the warm pool whose
  adapter is not read yet starts its read on a thread and goes on without it (WAIT_READ).

Identity is the content sha256: keys with the same content share one L2 copy and one slot, and a read that finds
content already held is skipped as "duplicate_content".

Registration is metadata only (`register`); the pool reads an adapter on first use (`acquire`, for a request being
admitted; `prefetch`, for one about to be; `warm`, for one predicted). `load` is the eager path: read and place now.
L3 reads pass the admission token bucket, except eager ones, which are counted but never refused. A read that fails
marks the key failed with the error, which its requests then fail with (or run on the base where they allow it); a
retriable error is retried by the next request, `adapter_changed` once the files change again (put back), any
other sticks until the key is registered again.

Every load is recorded (`pop_events`): its tier (disk = L3, host = L2, gpu = already resident), where it went, why,
and its duration, host read plus device copy (CUDA events on the side stream). Loads for requests, or eager ones, are
charged to the first request that uses the adapter after them (adapter_load_us); the warm pool's to nobody. Warm pool
hit rate: the share of requests with an adapter that found it in L1 or L2 when they arrived.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

from engine.adapter_reader import ReaderPool
from engine.adapter_records import Content, LoadEvent, Meta, ReadAhead, Record, files_stamp, read_adapter
from engine.adapter_residency import L1Placement
from engine.adapter_policy import TokenBucket
from engine.api import AdapterError, AdapterInfo
from engine.config import EngineConfig
from engine.host_arena import HostArena
from engine.lora import LoraState
from engine.model import ModelConfig
from engine.warm_pool import TrafficPredictor

WAIT_RATE = "rate_limited"  # acquire: the admission token bucket is empty
WAIT_SLOT = "no_free_slot"  # acquire: the pages or slots it needs are held by adapters of running requests
WAIT_READ = "reading"  # acquire: a read-ahead thread is reading it from the store
ARENA_HEADROOM = 4  # the L2 arena is host_cache_bytes and a quarter more (engine.host_arena)
MAX_EVENTS = 10_000  # load events kept for pop_events; older ones are dropped (and counted) if nobody drains them


class AdapterPool(L1Placement):
    def __init__(
        self,
        lora: LoraState,
        model: ModelConfig,
        config: EngineConfig,
        *,
        base_fingerprint: str | None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self._lora = lora
        self._model = model
        self._config = config
        self._fingerprint = base_fingerprint
        self._clock, self._wall = clock, wall_clock
        self._slot_bytes = lora.full_nbytes  # the eviction score's unit of memory: an adapter of max rank on every module
        self._records: dict[str, Record] = {}
        self._contents: dict[str, Content] = {}
        self._slots: list[str | None] = [None] * lora.max_loras
        # The eviction candidates' ranking, kept between placements (engine.adapter_residency "Ranking"): the entries
        # in order, each resident sha's entry, the clock of its scores, and whether a placement walk runs
        self._ranking: list | None = None
        self._rank_of: dict[str, tuple] = {}
        self._ranked_at = 0.0
        self._walking = False
        # Placements for requests (L1 room made, pages written) and the host time they took: what a step's placement walk
        # adds to the engine thread (the copies themselves run on the side stream)
        self.placements = self.placement_ns = 0
        self.l1_changes = 0  # counts changes of which keys are in L1 (`resident_keys`), so readers rebuild only on change
        self._l2: OrderedDict[str, int] = OrderedDict()  # sha -> bytes held in L2, least recently used first
        self._l2_bytes = 0
        procs = config.adapter_read_processes
        if config.host_cache_bytes and lora.arena is None:
            # L2 and what is on its way to and from it (reads ahead, transient copies): taken once, pinned on CUDA, shared
            # with the reader processes (which write their pages into it) where there are any
            lora.arena = HostArena(config.host_cache_bytes + config.host_cache_bytes // ARENA_HEADROOM, lora.dtype, lora.copy_stream,
                                   shared=procs > 0)  # fmt: skip
        reader = ReaderPool(procs, model, config, base_fingerprint, lora) if procs else None
        self._ahead = ReadAhead(max(config.adapter_read_threads, procs), reader)
        self._bucket = TokenBucket(config.adapter_loads_per_s, config.adapter_load_burst, clock)
        self._predictor = TrafficPredictor(alpha=config.warm_pool_alpha, recent_weight=config.warm_pool_recent_weight)
        self._last_warm: float | None = None
        self._events: deque[LoadEvent] = deque()
        self._infos: dict[str, AdapterInfo] = {}
        self.counters = {
            "loads_disk": 0, "loads_host": 0, "dedupe_skips": 0, "evictions_l1": 0, "evictions_l2": 0, "load_failures": 0,
            "loads_throttled": 0, "warm_prefetches": 0, "warm_prefetches_used": 0, "requests_warm": 0, "requests_cold": 0,
            "events_dropped": 0,
        }  # fmt: skip

    # ---- registration

    def register(self, key: str, path: Path, *, sha256: str | None = None, tenant: str = "", slo_tier: str = "standard") -> None:
        if key in self._records:
            raise AdapterError(
                f"adapter key {key!r} is already registered; unload it first or use a new key (e.g. name@version)",
                code="adapter_key_in_use",
            )
        if slo_tier not in self._config.adapter_slo_weights:
            raise AdapterError(
                f"slo_tier {slo_tier!r} of adapter {key!r} is not one of engine.adapter_slo_weights "
                f"{sorted(self._config.adapter_slo_weights)}; add it there or use one of those",
                code="invalid_slo_tier",
            )
        if sha256 is not None and (len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256)):
            raise AdapterError(f"sha256={sha256!r} for adapter {key!r} is not 64 lowercase hex digits", code="adapter_invalid")
        self._records[key] = Record(key, Path(path), sha256, tenant, slo_tier)
        if sha256 is not None and sha256 in self._contents:
            self._contents[sha256].keys.add(key)
            self._rescore(self._contents[sha256])

    def load(self, key: str, path: Path, *, tenant: str = "", slo_tier: str = "standard") -> AdapterInfo:
        """Register and load now, into a slot if one is free or can be freed; the key is dropped again if it fails."""
        self.register(key, path, tenant=tenant, slo_tier=slo_tier)
        rec = self._records[key]
        self._bucket.take()
        try:
            content, event = self._read(rec, reason="load_adapter")
        except AdapterError:
            self._drop_record(key)
            raise
        if content.slot is None:
            slot = self._make_room(content, exclude=())
            if slot is not None:
                event = self._copy_in(content, slot, event, reason="load_adapter", key=key)
        info = event.info()  # waits for the copy: the caller asked for a loaded adapter
        self._infos[key] = info
        return info

    def unload(self, key: str) -> None:
        """Forget `key`; the content goes when its last key goes. The caller checks no request uses the key."""
        if key not in self._records:
            raise AdapterError(f"adapter key {key!r} is not registered", code="unknown_adapter")
        self._drop_record(key)
        self._predictor.forget(key)

    def offload(self) -> int:
        """Give up the L1 pages and slots of every adapter no running request pins; each stays in L2 if it is there (its
        next use is an L2 load). Returns how many left L1."""
        gone = [sha for sha in self._slots if sha is not None and self._contents[sha].pins == 0]
        for sha in gone:
            self._evict(sha)
        return len(gone)

    def has(self, key: str) -> bool:
        return key in self._records

    def sha_of(self, key: str) -> str | None:
        """The content sha256 of `key`, or None before its first read when registered without one."""
        return self._records[key].sha

    def info(self, key: str) -> AdapterInfo:
        return self._infos[key]

    def resident(self) -> dict[int, str]:
        """slot -> sha256 of the adapters now in device memory."""
        return {i: sha for i, sha in enumerate(self._slots) if sha is not None}

    def resident_keys(self) -> list[str]:
        """Keys whose adapter is in a device slot now (a request for one starts without a load)."""
        return sorted(k for sha in self._slots if sha is not None for k in self._contents[sha].keys)

    def resident_slots(self) -> list[int]:
        """The device slots that hold an adapter now, in slot order."""
        return [slot for slot, sha in enumerate(self._slots) if sha is not None]

    # ---- requests

    def note_request(self, key: str) -> None:
        """A request for `key` arrived: heat, the predictor, and whether the warm pool had it ready."""
        rec = self._records[key]
        self._predictor.observe(key, self._wall())
        rec.heat.hit(self._clock())
        content = self._contents.get(rec.sha) if rec.sha else None
        if content is not None:
            self._rescore(content)
        ready = content is not None and (content.slot is not None or content.host is not None)
        self.counters["requests_warm" if ready else "requests_cold"] += 1

    def acquire(self, key: str) -> tuple[int, list[LoadEvent]] | str:
        """Pin `key`'s adapter in a slot for a request: (slot, loads to charge it), or WAIT_RATE / WAIT_SLOT.
        Raises the key's AdapterError if it cannot be loaded."""
        content = self._ensure_slot(key, exclude=(), reason="request")
        if isinstance(content, str):
            return content
        content.pins += 1
        content.last_used = self._clock()
        self._rescore(content)
        if content.warm:
            content.warm = False
            self.counters["warm_prefetches_used"] += 1
        charges, content.uncharged = content.uncharged, []
        assert content.slot is not None
        return content.slot, charges

    def waits_for_read(self, key: str) -> bool:
        """Whether `acquire(key)` would only answer WAIT_READ now: `awaits_read`, and the read is under way, or not started
        with no room to start it. A cheap check, so that admission skips such a request before its prefix-cache lookup
        (with a thousand requests queued behind reads, the lookups of those that could not run anyway cost each step
        milliseconds)."""
        return self.awaits_read(key) and (self._ahead.pending(key) or not self._ahead.has_room())

    def awaits_read(self, key: str) -> bool:
        """Whether a request for `key` has to wait for a store read before it can run: with read-ahead threads, the
        adapter is in neither L1 nor L2 and no read of it has finished (one is under way, or none started yet). Admission
        holds back while most of the requests it could take are in that state (engine.admission)."""
        if not self._ahead.threads:
            return False
        rec = self._records.get(key)
        if rec is None or rec.error is not None:
            return False
        content = self._contents.get(rec.sha) if rec.sha else None
        if content is not None and (content.slot is not None or content.host is not None):
            return False
        return not self._ahead.done(key)

    def release(self, sha: str) -> None:
        content = self._contents[sha]
        assert content.pins > 0, sha
        content.pins -= 1

    def prefetch(self, key: str, exclude: Iterable[int]) -> int | str | None:
        """Bring a waiting request's adapter into a slot ahead of its admission, without pinning it; returns
        the slot, WAIT_SLOT when L1 has no room for it (not without evicting `exclude` or pinned adapters), or None
        if it must wait for anything else. Errors are kept on the key for its admission to report."""
        if self.read_ahead(key) or self._ahead.pending(key):
            return None  # read on a thread, off the step's path; placed by a later prefetch or its admission
        try:
            content = self._ensure_slot(key, exclude=frozenset(exclude), reason="request")
        except AdapterError:
            return None
        if isinstance(content, str):
            return WAIT_SLOT if content == WAIT_SLOT else None
        return content.slot

    def read_ahead(self, key: str) -> bool | None:
        """Start reading a waiting request's adapter from the store on a read-ahead thread, if it is in neither L1 nor L2
        and no read of it is under way, and a thread and the admission bucket allow: True if one started, False if none
        was needed (or there are no threads), None if one was needed and could not start (no room, or no token). Nothing
        else: no slot is taken (`prefetch` places)."""
        rec = self._records[key]
        content = self._contents.get(rec.sha) if rec.sha else None
        if rec.error is not None or not self._ahead.threads or (content is not None and (content.slot is not None or content.host is not None)):
            return False
        if self._ahead.pending(key) or self._ahead.done(key):
            return False
        if not self._ahead.has_room() or not self._bucket.try_take():
            return None
        self._ahead.start(rec, self._model, self._config, self._fingerprint, self._lora)
        return True

    def close(self) -> None:
        """Stop the reader processes, if any; reads ahead are not started again (the pool stays usable, reading on the
        engine thread)."""
        if self._ahead.reader is not None:
            self._ahead.reader.close()
            self._ahead.reader = None

    def failed(self, key: str) -> AdapterError | None:
        return self._records[key].error

    def wait_s(self) -> float:
        """Seconds until the admission bucket has a token."""
        return self._bucket.wait_s()

    # ---- warm pool

    def warm(self) -> None:
        """Every warm_pool_interval_s: load the adapters forecast to be used in the coming hour into L2, and
        into free L1 slots, within the warm pool's budgets; never evicting, never waiting for the bucket."""
        now = self._clock()
        if self._last_warm is not None and now - self._last_warm < self._config.warm_pool_interval_s:
            return
        self._last_warm = now
        cfg = self._config
        warm_bytes = sum(c.meta.nbytes for c in self._contents.values() if c.warm and c.host is not None)
        warm_slots = sum(1 for c in self._contents.values() if c.warm and c.slot is not None)
        for key, _forecast in self._predictor.ranked(self._wall(), cfg.warm_pool_min_per_hour):
            rec = self._records.get(key)
            if rec is None or rec.error is not None:
                continue
            content = self._contents.get(rec.sha) if rec.sha else None
            if content is not None and content.slot is not None:
                continue
            event = None
            if content is None or content.host is None:
                size = content.meta.nbytes if content is not None else 1  # unknown until read: at least a byte
                if warm_bytes + size > cfg.warm_pool_host_bytes or self._ahead.pending(key):
                    continue
                if self._ahead.threads and not self._ahead.done(key):
                    # On the read-ahead threads, as every store read with threads is: this pass starts the read, and the
                    # next pass (or the key's first request) takes its result.
                    if self._ahead.has_room() and self._bucket.try_take():
                        self._ahead.start(rec, self._model, self._config, self._fingerprint, self._lora)
                    continue
                if not self._ahead.done(key) and not self._bucket.try_take():
                    continue
                try:
                    content, event = self._read(rec, reason="warm_pool")
                except AdapterError:
                    continue
                content.warm = True
                warm_bytes += content.meta.nbytes
                self.counters["warm_prefetches"] += 1
            if content.slot is None and warm_slots < cfg.warm_pool_slots:
                slot = self._make_room(content, exclude=(), evict=False)
                if slot is not None:
                    self._copy_in(content, slot, event, reason="warm_pool", key=key)
                    content.warm = True
                    warm_slots += 1

    # ---- metrics

    def pop_events(self) -> list[AdapterInfo]:
        events, self._events = self._events, deque()
        return [e.info() for e in events]

    @property
    def reads_in_flight(self) -> int:
        """Store reads queued or running on the read-ahead threads."""
        return self._ahead.in_flight

    @property
    def read_spans(self) -> list[tuple[float, float]]:
        """(time.perf_counter() when it began on its thread, when it landed) of the recent store reads read ahead."""
        return list(self._ahead.spans)

    @property
    def reads_landed(self) -> int:
        """Store reads finished on the read-ahead threads and not yet taken into L2."""
        return self._ahead.landed

    def stats(self) -> dict:
        c = self.counters
        asked = c["requests_warm"] + c["requests_cold"]
        return {
            "lora_slots": self._lora.max_loras,
            "lora_slots_used": sum(1 for s in self._slots if s is not None),
            "lora_slots_pinned": sum(1 for s in self._slots if s is not None and self._contents[s].pins > 0),
            "lora_slots_bytes": self._lora.nbytes,  # the page pool's bytes
            "lora_pool_used_bytes": self._lora.allocator.used_elems() * self._lora.pool.element_size(),
            "lora_memory_used_bytes": sum(self._contents[s].meta.nbytes for s in self._slots if s is not None),
            "adapter_host_bytes": self._l2_bytes,
            "adapter_host_capacity_bytes": self._config.host_cache_bytes,
            # L2's host memory, taken at start (engine.host_arena); a miss is a copy that found no extent and took its own
            "adapter_host_arena_bytes": self._lora.arena.nbytes if self._lora.arena is not None else 0,
            "adapter_host_arena_misses": self._lora.arena.misses if self._lora.arena is not None else 0,
            "adapters_registered": len(self._records),
            "adapter_loads": {"disk": c["loads_disk"], "host": c["loads_host"]},
            "adapter_dedupe_skips": c["dedupe_skips"],
            "adapter_evictions": {"gpu": c["evictions_l1"], "host": c["evictions_l2"]},
            "adapter_load_failures": c["load_failures"],
            "adapter_loads_throttled": c["loads_throttled"],
            "adapter_load_events_dropped": c["events_dropped"],
            "warm_pool_hit_rate": c["requests_warm"] / asked if asked else 0.0,
            "warm_pool_hits": c["requests_warm"],
            "warm_pool_misses": c["requests_cold"],
            "warm_pool_prefetches": c["warm_prefetches"],
            "warm_pool_prefetches_used": c["warm_prefetches_used"],
        }

    # ---- internals

    def _ensure_slot(self, key: str, exclude: Collection[int], reason: str) -> Content | str:
        rec = self._records[key]
        if rec.error is not None:
            # Files that failed to load (changed under the registered sha256, gone, a link, corrupt, ...) are read again
            # once they change (put back: `lorabatch adapters add` of the adapter's folder repairs its store entry); until
            # then, a stat per use, no read.
            changed_since = rec.error_files is not None and files_stamp(rec.path) != rec.error_files
            if not rec.error.retriable and not changed_since:
                raise rec.error
            rec.error = None
        content = self._contents.get(rec.sha) if rec.sha else None
        event = None
        if content is None or (content.slot is None and content.host is None):
            if self._ahead.pending(key):
                return WAIT_READ  # a read-ahead thread is reading it: the step goes on without it
            if not self._ahead.done(key):
                # With read-ahead threads the engine thread never reads the store: a read there held a step for its
                # 12-80 ms (H200, issue 19: decode steps with a load at p99 20-50 ms against a 2.6 ms median).
                if self._ahead.threads and not self._ahead.has_room():
                    return WAIT_READ  # started by a later prefetch or admission, when a read ahead of it ends
                if not self._bucket.try_take():
                    self.counters["loads_throttled"] += 1
                    return WAIT_RATE
                if self._ahead.threads:
                    self._ahead.start(rec, self._model, self._config, self._fingerprint, self._lora)
                    return WAIT_READ
            content, event = self._read(rec, reason=reason)
        if content.slot is None:
            t0 = time.perf_counter_ns()
            slot = self._make_room(content, exclude)
            if slot is None:
                return WAIT_SLOT
            self._copy_in(content, slot, event, reason=reason, key=key)
            self.placements += 1
            self.placement_ns += time.perf_counter_ns() - t0
        return content

    def _read(self, rec: Record, *, reason: str) -> tuple[Content, LoadEvent]:
        """Read `rec` from L3 into L2 (or take what a read-ahead thread read), or find its content held already (an event
        with skip_reason "duplicate_content", tier where it was found, never charged to a request)."""
        t0 = time.perf_counter_ns()
        future = self._ahead.take(rec.key)
        try:
            sha, host, read_us = future.result() if future is not None else read_adapter(rec, self._model, self._config, self._fingerprint, self._lora)
        except OSError as e:
            raise self._fail(rec, AdapterError(f"cannot read adapter {rec.key!r} at {rec.path}: {e}", code="adapter_unavailable", retriable=True), reason) from e
        except AdapterError as e:
            if rec.sha is not None and e.code in ("adapter_missing", "adapter_unsafe"):  # files that were read before
                e = AdapterError(f"{e} (adapter {rec.key!r} was whole when registered or last read: put its files back, e.g. "
                                 "by adding its folder again, and its next request reads them again)", code=e.code)  # fmt: skip
            raise self._fail(rec, e, reason, files=files_stamp(rec.path)) from e
        if future is None:
            read_us = (time.perf_counter_ns() - t0) // 1000
        if rec.sha is not None and sha != rec.sha:
            raise self._fail(rec, AdapterError(
                f"adapter {rec.key!r}: the files at {rec.path} hash to {sha}, not {rec.sha} as registered; they changed "
                "since: put the registered content back (adding the adapter's folder again does), or register the new "
                "content under a new key (name@version)",
                code="adapter_changed",
            ), reason, files=files_stamp(rec.path))  # fmt: skip
        content = self._contents.get(sha)
        if content is not None and (content.host is not None or content.slot is not None):
            self._link(rec, content)
            where = "gpu" if content.slot is not None else "host"
            event = self._event(rec, content, where, where, reason, skip_reason="duplicate_content")
            event.read_us = read_us
            self.counters["dedupe_skips"] += 1
            return content, event
        assert host is not None, rec.key
        if not self._lora.allocator.could_fit(self._lora.page_need(host)):
            raise self._fail(rec, AdapterError(f"adapter {rec.key!r} (rank {host.rank}) needs {host.nbytes} B of device memory, more "
                f"than the pool of engine.adapter_gpu_bytes={self._lora.nbytes} holds; raise it, or use a lower rank or fewer "
                "target modules", code="adapter_too_large"), reason)  # fmt: skip
        meta = Meta(host.rank, host.alpha, host.use_rslora, host.target_modules, host.nbytes)
        if content is None:
            content = self._contents[sha] = Content(sha, meta)
        content.host = host
        self._link(rec, content)
        self._l2_insert(content)
        event = self._event(rec, content, "disk", "host", reason)
        event.read_us = read_us
        self.counters["loads_disk"] += 1
        return content, event

    def _copy_in(self, content: Content, slot: int, event: LoadEvent | None, *, reason: str, key: str) -> LoadEvent:
        """Write content (held in host memory) into a free slot; `event` is its read if it just had one: an L3
        load goes on to the slot as one load, anything else makes the copy an L2 load of its own."""
        assert self._slots[slot] is None and content.slot is None and content.host is not None, (slot, content.sha)
        if event is None or event.tier != "disk" or event.skip_reason is not None:
            event = self._event(self._records[key], content, "host", "gpu", reason)
            self.counters["loads_host"] += 1
        event.dest = "gpu"
        assert content.pages is not None, content.sha
        event.copy = self._lora.write(slot, content.host, [offsets for _, offsets in content.pages])
        self._slots[slot] = content.sha
        self.l1_changes += 1
        content.slot = slot
        self._rescore(content)
        if content.sha not in self._l2:
            content.host = None  # a transient copy (larger than L2): the slot now holds it
        if content.sha in self._l2:
            self._l2.move_to_end(content.sha)
        return event

    def _link(self, rec: Record, content: Content) -> None:
        rec.sha = content.sha
        content.keys.add(rec.key)
        self.l1_changes += 1
        self._rescore(content)  # its heat and tier are its keys'

    def _event(self, rec: Record, content: Content, tier: str, dest: str, reason: str, *, skip_reason: str | None = None) -> LoadEvent:
        event = LoadEvent(rec.key, content.sha, tier, dest, reason, rec.tenant, content.meta, skip_reason=skip_reason)
        self._record(event)
        if skip_reason is None and reason != "warm_pool":  # a warm load is one no request waits for
            content.uncharged.append(event)
        return event

    def _fail(self, rec: Record, error: AdapterError, reason: str, files: tuple | None = None) -> AdapterError:
        rec.error, rec.error_files = error, files
        self.counters["load_failures"] += 1
        self._record(LoadEvent(rec.key, rec.sha or "", "disk", "none", reason, rec.tenant, None, error_code=error.code))
        return error

    def _record(self, event: LoadEvent) -> None:
        if len(self._events) >= MAX_EVENTS:
            self._events.popleft()
            self.counters["events_dropped"] += 1
        self._events.append(event)

    def _drop_record(self, key: str) -> None:
        self._ahead.take(key)  # a read in flight is dropped with its key
        rec = self._records.pop(key)
        self._infos.pop(key, None)
        content = self._contents.get(rec.sha) if rec.sha else None
        if content is None:
            return
        content.keys.discard(key)
        self.l1_changes += 1
        if content.keys:
            self._rescore(content)
            return
        assert content.pins == 0, f"unloading {key!r} while {content.pins} requests pin it"
        if content.slot is not None:
            self._free_pages(content)
            self._slots[content.slot] = None
        if content.sha in self._l2:
            self._l2_bytes -= self._l2.pop(content.sha)
        del self._contents[content.sha]
        self._rescore(content)  # (gone: out of the ranking)
