"""Where an adapter goes in L1 (and how L2 makes room): a free slot (a page-table row) and its pages, evicting by keep score to make room.

Unpinned adapters go lowest keep score first (engine.adapter_policy: heat, SLO tier, memory cost), one at a time,
until both a slot and the pages are free; which ones is decided on counts first (PageAllocator.trial), so nothing is
evicted for an adapter that would still not fit. Adapters of running requests are pinned and never chosen. L2 is an
LRU by bytes; an adapter larger than all of it is kept only until it reaches L1.

Ranking. Finding the lowest keep score means scoring every resident adapter (about 900 at llama-1b with 2,000
registered: 0.8 ms on this machine's CPU, 1-1.8 ms of a decode step's host time on the H100's). So the candidates are
ranked once, scores taken at one time, and the ranking is kept: each change of a resident adapter's heat, keys, last use
or slot moves its entry alone (scored at the ranking's time), and it is made afresh when RANK_TTL_S old, outside a
placement walk (`placing`), or at the first eviction of a walk that began with it older. Scores decay with the heat
window (minutes): within RANK_TTL_S of their time the order moves by under 0.5% of a score.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator
from contextlib import contextmanager

from engine.adapter_policy import keep_score_of

# How long a ranking of the eviction candidates is reused outside a placement walk (module docstring, "Ranking").
RANK_TTL_S = 1.0


class L1Placement:
    """AdapterPool's L1 mechanics (a mixin over its _slots, _contents, _records, _l2, _l2_bytes, _lora, _config, _clock, counters)."""

    def _make_room(self, content, exclude: Collection[int], *, evict: bool = True) -> int | None:
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

    @contextmanager
    def placing(self) -> Iterator[None]:
        """One walk of placements (a step's admissions, a load-ahead walk): the ranking of eviction candidates is not
        renewed inside it, so that every placement of the walk sees scores of one time. Walks nest (the outer one
        counts); one cut short by an exception drops the ranking."""
        if self._walking:
            yield
            return
        if self._ranking is not None and self._clock() - self._ranked_at > RANK_TTL_S:
            self._ranking = None  # ranked afresh at the walk's first eviction
        self._walking = True
        try:
            yield
        except BaseException:
            self._ranking = None
            raise
        finally:
            self._walking = False

    def _victims(self, exclude: Collection[int], need: dict[int, int]) -> list[str] | None:
        """The unpinned adapters to evict, lowest keep score first, so that a slot and `need` pages are free; None if
        evicting every candidate would not do. Decided on counts, before anything is evicted."""
        if self._ranking is None or (not self._walking and self._clock() - self._ranked_at > RANK_TTL_S):
            self._rank_all(self._clock())
        trial = self._lora.allocator.trial()
        free_slot = None in self._slots
        victims: list[str] = []
        entries = iter(self._ranking)
        while not (free_slot and trial.fits(need)):
            for _, sha in entries:
                c = self._contents.get(sha)
                if c is not None and c.slot is not None and c.pins == 0 and c.slot not in exclude:
                    break
            else:
                return None
            victims.append(sha)
            for size, offsets in c.pages:
                trial.free(size, offsets)
            free_slot = True
        return victims

    def _rank(self, now: float) -> list[tuple[tuple[float, float, int], str]]:
        """Every resident adapter (pinned ones too: skipped when chosen), lowest keep score first, then least recently
        used, then lowest slot (engine.adapter_policy: `choose_victim`'s order)."""
        contents, entry = self._contents, self._rank_entry
        return sorted(entry(contents[sha], now) for sha in self._slots if sha is not None)

    def _rank_all(self, now: float) -> None:
        """Rank every resident adapter at `now`: the ranking kept from here (module docstring, "Ranking")."""
        self._ranking, self._ranked_at = self._rank(now), now
        self._rank_of = {entry[1]: entry for entry in self._ranking}

    def _rank_entry(self, c, now: float) -> tuple[tuple[float, float, int], str]:
        """(keep score, last used, slot), sha: engine.adapter_policy's keep score of `c` at `now`, from its parts (a walk
        ranks about 900 adapters at llama-1b: 0.77 ms on this machine's CPU, 2.4 through Candidate objects)."""
        weights = self._config.adapter_slo_weights
        if len(c.keys) == 1:
            rec = self._records[next(iter(c.keys))]
            heat, slo_weight = rec.heat.rate(now), weights[rec.slo_tier]
        else:
            recs = [self._records[k] for k in c.keys]
            heat = sum(r.heat.rate(now) for r in recs)
            slo_weight = max((weights[r.slo_tier] for r in recs), default=weights["standard"])
        score = keep_score_of(heat, slo_weight, c.meta.nbytes, mem_weight=self._config.adapter_mem_weight, slot_bytes=self._slot_bytes)
        return (score, c.last_used, c.slot), c.sha

    def _rescore(self, content) -> None:
        """`content`'s heat, keys, last use or slot changed: its entry in the ranking (if one is kept) follows, scored at
        the ranking's time, or leaves it when `content` has no slot (or is gone)."""
        if self._ranking is None:
            return
        old = self._rank_of.pop(content.sha, None)
        if old is not None:
            i = bisect.bisect_left(self._ranking, old)
            assert self._ranking[i] is old, (content.sha, old)
            del self._ranking[i]
        if content.slot is not None and self._contents.get(content.sha) is content:
            entry = self._rank_entry(content, self._ranked_at)
            bisect.insort(self._ranking, entry)
            self._rank_of[content.sha] = entry

    def _evict(self, sha: str) -> None:
        """Give up `sha`'s slot and pages (it stays in L2 if it is there)."""
        content = self._contents[sha]
        assert content.slot is not None and content.pins == 0, (sha, content.slot, content.pins)
        self._free_pages(content)
        self._slots[content.slot] = None
        self.l1_changes += 1
        content.slot = None
        self._rescore(content)
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
