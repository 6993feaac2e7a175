"""A circuit breaker per adapter: above a failure rate its jobs fail fast (or run on the base where
allowed) until a half-open probe succeeds.

closed --(failure rate >= threshold over >= min_requests in the window)--> open
open --(cooldown elapsed)--> half-open: one probe job goes through
half-open --(probe succeeds)--> closed;  --(probe fails)--> open again

The window's outcomes are counted in BUCKETS buckets of window_s / BUCKETS each, not kept one by one: a pair per
outcome, summed at each, held 50,000 pairs for one adapter serving ~830 jobs a second and took 13 s of the event loop
for them (O(n^2)). An outcome leaves the window once its bucket's latest one is window_s old: never sooner than
window_s after it came, at most one bucket (1 s of 60) later.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


BUCKETS = 60  # buckets per window


@dataclass
class _Circuit:
    outcomes: deque = field(default_factory=deque)  # [bucket number, latest time, ok count, failed count], oldest first
    total: int = 0  # outcomes in `outcomes`
    failed: int = 0  # of them, failures
    state: str = "closed"
    opened_at: float = 0.0
    probe_out: bool = False


class BreakerBoard:
    def __init__(self, failure_rate: float = 0.5, min_requests: int = 5, window_s: float = 60.0,
                 cooldown_s: float = 10.0, clock=time.monotonic):
        assert 0 < failure_rate <= 1 and min_requests >= 1 and window_s > 0, (failure_rate, min_requests, window_s)
        self.failure_rate = failure_rate
        self.min_requests = min_requests
        self.window_s = window_s
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._circuits: dict[str, _Circuit] = {}

    def state(self, key: str) -> str:
        c = self._circuits.get(key)
        if c is None:
            return "closed"
        if c.state == "open" and self._clock() - c.opened_at >= self.cooldown_s:
            c.state, c.probe_out = "half_open", False
        return c.state

    def allow(self, key: str) -> bool:
        """May a job for this adapter go to the engine now? In half-open, only one probe at a time."""
        state = self.state(key)
        if state == "closed":
            return True
        if state == "half_open" and not self._circuits[key].probe_out:
            self._circuits[key].probe_out = True
            return True
        return False

    def record(self, key: str, ok: bool) -> None:
        c = self._circuits.setdefault(key, _Circuit())
        now = self._clock()
        if c.state == "half_open":
            c.state = "closed" if ok else "open"
            c.opened_at, c.probe_out = now, False
            c.outcomes.clear()
            c.total = c.failed = 0
            return
        self._expire(c, now)
        bucket = int(now * BUCKETS // self.window_s)
        if not c.outcomes or c.outcomes[-1][0] != bucket:
            c.outcomes.append([bucket, now, 0, 0])
        last = c.outcomes[-1]
        last[1] = now
        last[2 if ok else 3] += 1
        c.total += 1
        c.failed += not ok
        if c.state == "closed" and c.total >= self.min_requests and c.failed / c.total >= self.failure_rate:
            c.state, c.opened_at = "open", now

    def _expire(self, c: _Circuit, now: float) -> None:
        """Drop the buckets whose latest outcome is past the window."""
        while c.outcomes and now - c.outcomes[0][1] > self.window_s:
            _, _, good, bad = c.outcomes.popleft()
            c.total -= good + bad
            c.failed -= bad

    def no_verdict(self, key: str) -> None:
        """A job let through for `key` ended with nothing said about the adapter (the engine failed, or a bug of ours):
        where it was the half-open probe, the next job may probe, where the circuit stayed half-open refusing all."""
        c = self._circuits.get(key)
        if c is not None and c.state == "half_open":
            c.probe_out = False

    def failures(self, key: str) -> int:
        """The failures recorded for `key` within the window (0 if none were)."""
        c = self._circuits.get(key)
        if c is None:
            return 0
        self._expire(c, self._clock())
        return c.failed

    def open_circuits(self) -> list[str]:
        return [k for k in self._circuits if self.state(k) != "closed"]
