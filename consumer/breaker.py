"""A circuit breaker per adapter: above a failure rate its jobs fail fast (or run on the base where
allowed) until a half-open probe succeeds.

closed --(failure rate >= threshold over >= min_requests in the window)--> open
open --(cooldown elapsed)--> half-open: one probe job goes through
half-open --(probe succeeds)--> closed;  --(probe fails)--> open again
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Circuit:
    outcomes: deque = field(default_factory=deque)  # (time, ok)
    state: str = "closed"
    opened_at: float = 0.0
    probe_out: bool = False


class BreakerBoard:
    def __init__(self, failure_rate: float = 0.5, min_requests: int = 5, window_s: float = 60.0,
                 cooldown_s: float = 10.0, clock=time.monotonic):
        assert 0 < failure_rate <= 1 and min_requests >= 1
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
            return
        c.outcomes.append((now, ok))
        while c.outcomes and now - c.outcomes[0][0] > self.window_s:
            c.outcomes.popleft()
        failures = sum(1 for _, good in c.outcomes if not good)
        if c.state == "closed" and len(c.outcomes) >= self.min_requests and failures / len(c.outcomes) >= self.failure_rate:
            c.state, c.opened_at = "open", now

    def no_verdict(self, key: str) -> None:
        """A job let through for `key` ended with nothing said about the adapter (the engine failed, or a bug of ours):
        where it was the half-open probe, the next job may probe, where the circuit stayed half-open refusing all."""
        c = self._circuits.get(key)
        if c is not None and c.state == "half_open":
            c.probe_out = False

    def failures(self, key: str) -> int:
        """The failures recorded for `key` within the window (0 if none were)."""
        c = self._circuits.get(key)
        now = self._clock()
        return 0 if c is None else sum(1 for t, ok in c.outcomes if not ok and now - t <= self.window_s)

    def open_circuits(self) -> list[str]:
        return [k for k in self._circuits if self.state(k) != "closed"]
