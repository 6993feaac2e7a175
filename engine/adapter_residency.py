"""Where an adapter goes in L1 (and how L2 makes room): a free slot (a page-table row) and its pages, evicting by keep score to make room.

Unpinned adapters go lowest keep score first (engine.adapter_policy: heat, SLO tier, memory cost), one at a time,
until both a slot and the pages are free; which ones is decided on counts first (PageAllocator.trial), so nothing is
evicted for an adapter that would still not fit. Adapters of running requests are pinned and never chosen. L2 is an
LRU by bytes; an adapter larger than all of it is kept only until it reaches L1.
"""

from __future__ import annotations

from engine.adapter_policy import Candidate, choose_victim


class L1Placement:
    """AdapterPool's L1 mechanics (a mixin over its _slots, _contents, _records, _l2, _l2_bytes, _lora, _config, _clock, counters)."""

    def _make_room(self, content, exclude: tuple[int, ...], *, evict: bool = True) -> int | None:
        """A free slot and the pages of `content` (held in host memory), taken for it (content.pages), evicting unpinned
        adapters with the lowest keep score, one at a time, until both are free (never those in `exclude`, nor any when
        not `evict`); None, and nothing evicted, when they cannot be had."""
        assert content.host is not None and content.slot is None, content.sha
        lora = self._lora
        need = lora.page_need(content.host)
        total: dict[int, int] = {}
        for size, n in need:
            total[size] = total.get(size, 0) + n
        victims = []
        if None not in self._slots or not lora.allocator.fits(total):
            if not evict:
                return None
            victims = self._victims(exclude, total)
            if victims is None:
                return None
        for sha in victims:
            self._evict(sha)
        pages = lora.allocator.alloc(need)
        assert pages is not None, (content.sha, need)
        content.pages = [(size, offsets) for (size, _), offsets in zip(need, pages)]
        return self._slots.index(None)

    def _victims(self, exclude: tuple[int, ...], need: dict[int, int]) -> list[str] | None:
        """The unpinned adapters to evict, lowest keep score first, so that a slot and `need` pages are free; None if
        evicting every candidate would not do. Decided on counts, before anything is evicted."""
        now = self._clock()
        weights = self._config.adapter_slo_weights
        candidates = []
        for slot, sha in enumerate(self._slots):
            if sha is None:
                continue
            c = self._contents[sha]
            if c.pins == 0 and slot not in exclude:
                recs = [self._records[k] for k in c.keys]
                heat = sum(r.heat.rate(now) for r in recs)
                slo_weight = max((weights[r.slo_tier] for r in recs), default=weights["standard"])
                candidates.append(Candidate(c.sha, heat, slo_weight, c.meta.nbytes, c.last_used))
        alloc = self._lora.allocator
        trial = alloc.trial()
        free_slot = None in self._slots
        victims: list[str] = []
        while not (free_slot and trial.fits(need)):
            victim = choose_victim(candidates, mem_weight=self._config.adapter_mem_weight, slot_bytes=self._slot_bytes)
            if victim is None:
                return None
            candidates = [c for c in candidates if c.sha != victim]
            victims.append(victim)
            for size, offsets in self._contents[victim].pages:
                trial.free(size, offsets)
            free_slot = True
        return victims

    def _evict(self, sha: str) -> None:
        """Give up `sha`'s slot and pages (it stays in L2 if it is there)."""
        content = self._contents[sha]
        assert content.slot is not None and content.pins == 0, (sha, content.slot, content.pins)
        self._free_pages(content)
        self._slots[content.slot] = None
        self.l1_changes += 1
        content.slot = None
        self.counters["evictions_l1"] += 1

    def _free_pages(self, content) -> None:
        assert content.pages is not None, content.sha
        for size, offsets in content.pages:
            self._lora.allocator.free(size, offsets)
        content.pages = None

    def _l2_insert(self, content: Content) -> None:
        size = content.meta.nbytes
        cap = self._config.host_cache_bytes
        if size > cap:
            return  # transient: kept only until it reaches a slot
        while self._l2_bytes + size > cap:
            sha, nbytes = self._l2.popitem(last=False)
            self._l2_bytes -= nbytes
            self._contents[sha].host = None
            self.counters["evictions_l2"] += 1
        self._l2[content.sha] = size
        self._l2_bytes += size
