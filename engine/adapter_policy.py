"""The adapter pool's policies, apart from its mechanics: what to evict, and how fast to admit.

Eviction score (seed 000, "dynamic bucketing"). When an L1 slot is needed and none is free, the
unpinned resident adapter with the lowest keep score goes:

    keep(a) = (heat(a) + 1 / HEAT_WINDOW_S) * slo_weight(tier(a)) * (1 + mem_weight * bytes(a) / slot_bytes)

- heat: requests per second over about the last five minutes (an exponentially decaying count with a
  300 s time constant), so an adapter hot ten minutes ago and idle since scores like a cold one:
  seed 000's "routing thrash", where a burst leaves an adapter squatting on a slot, is what this undoes.
  The floor 1/300 (one request in the window) keeps a never-used adapter from scoring zero, so the
  other two factors still order such adapters.
- slo_weight: the tenant's SLO tier (config `adapter_slo_weights`, e.g. premium 4, standard 1, batch
  0.25): a stricter tier keeps its adapters resident longer, so its requests meet cold starts less.
- memory cost: the adapter's bytes over a slot's (its reload cost: what must cross PCIe again). Seed 000
  reports that with this weight at 0 rarely used but large adapters were evicted and reloaded over and
  over; a positive weight keeps those and evicts small rarely used ones first.

Ties (equal scores) go to the least recently used. Example, slot of 2.7 MB, mem_weight 1: adapter A
(standard, 0.5 req/s, 0.3 MB) keeps 0.503 * 1 * 1.11 = 0.56; adapter B (premium, 0.05 req/s, 2.7 MB)
keeps 0.053 * 4 * 2 = 0.43; B is evicted first despite its tier, being ten times colder.

Admission rate (seed 002, incident 1: eight adapters registered at once saturated PCIe and pushed the
other requests' loads from 50 ms to 800 ms). Reads from the store (L3) pass a token bucket of
`adapter_loads_per_s` with depth `adapter_load_burst`; a request whose adapter must wait for a token
stays queued while the others run. Loads from host memory (L2) are not limited: they are the cheap path
the limiter protects.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

HEAT_WINDOW_S = 300.0


class Heat:
    """Requests per second over about the last HEAT_WINDOW_S seconds (exponential decay)."""

    def __init__(self) -> None:
        self._rate = 0.0
        self._at = 0.0

    def hit(self, now: float) -> None:
        self._rate = self.rate(now) + 1.0 / HEAT_WINDOW_S
        self._at = now

    def rate(self, now: float) -> float:
        return self._rate * math.exp(-max(0.0, now - self._at) / HEAT_WINDOW_S)


@dataclass(frozen=True)
class Candidate:
    """A resident, unpinned adapter that could give up its slot."""

    sha: str
    heat: float  # requests per second (Heat.rate)
    slo_weight: float
    nbytes: int
    last_used: float  # clock of its last use; smaller is older


def keep_score(c: Candidate, *, mem_weight: float, slot_bytes: int) -> float:
    """The module docstring's keep score; the lowest is evicted first."""
    return keep_score_of(c.heat, c.slo_weight, c.nbytes, mem_weight=mem_weight, slot_bytes=slot_bytes)


def keep_score_of(heat: float, slo_weight: float, nbytes: int, *, mem_weight: float, slot_bytes: int) -> float:
    """`keep_score` from its parts, with no Candidate made: the pool's placement walks rank about 900 resident adapters
    at a time (engine.adapter_residency `_rank`)."""
    return (heat + 1.0 / HEAT_WINDOW_S) * slo_weight * (1.0 + mem_weight * nbytes / slot_bytes)


def choose_victim(candidates: Iterable[Candidate], *, mem_weight: float, slot_bytes: int) -> str | None:
    """The sha of the adapter to evict, or None when there is no candidate."""
    best = min(candidates, key=lambda c: (keep_score(c, mem_weight=mem_weight, slot_bytes=slot_bytes), c.last_used), default=None)
    return None if best is None else best.sha


class TokenBucket:
    """At most `rate` takes per second on average, `burst` back to back."""

    def __init__(self, rate: float, burst: int, clock: Callable[[], float]):
        assert rate > 0 and burst >= 1, (rate, burst)
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._tokens = float(burst)
        self._at = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now

    def try_take(self) -> bool:
        self._refill()
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False

    def take(self) -> None:
        """Take a token even if none is left (eager loads asked for by the operator): later takes wait longer."""
        self._refill()
        self._tokens -= 1

    def wait_s(self) -> float:
        """Seconds until a token is available (0 if one is)."""
        self._refill()
        return max(0.0, (1 - self._tokens) / self.rate)
