"""Where a job's time goes in the worker, stage by stage, and how much of the engine's time its GPU sat idle.

Stages. Each job that reaches the fair scheduler carries a `Stamps`: eight monotonic-ns timestamps, taken where the
worker already is (no logging, no extra awaits). The seven stages between them:

| stage | from | to |
| --- | --- | --- |
| fetch | the broker fetch that brought the job returned | parsed and looked up among stored answers |
| route | looked up | routed and queued in the fair scheduler |
| queue | queued | its first engine step (the worker's scheduler and the engine's own waiting list) |
| engine | its first engine step | its result back on the event loop |
| publish | result back | the broker acknowledged the result |
| ledger | acknowledged | its ledger row written (or spooled) |
| commit | row written | its offset committed |

The first engine step is read from the engine's own clock: the engine counts `queue_us` from the request's arrival,
which the worker sets to the moment it queued the job (consumer.intake), on the same monotonic clock.
`StageLog` takes a job's stamps when its offset commits, observes the seven stages in the
`lorabatch_stage_seconds{stage}` histogram (seven label values) and, for `lorabatch bench pipeline`, keeps the last
`keep` jobs' stamps. Jobs answered without the engine (invalid, refused, replayed) have no stamps. It holds at most
MAX_WAITING jobs' stamps waiting for their commit: while commits fail (a broker that refuses them, a group that keeps
rebalancing), a job billed past that bound has its first six stages observed at once and its commit stage never
(`lorabatch_stage_records_dropped_total`, and one log line); its offset commits as any other's, since the stamps are
only ever read for the histogram.

GPU idle share. The engine's step records carry each step's device time but no wall-clock start or end
(engine.timing.StepRecord), so the wall span is taken on the worker's side: `EngineClock` counts the time during
which at least one of the worker's jobs was in the engine (from the dispatch that took it from none to one, to the
result that took it back to none), and the device time of the steps drained meanwhile (consumer.feeder
`drain_gpu_time`). Idle share = 1 - device time / that span: the part of the time the engine had work in which the
GPU computed none of it (host work between steps, waits for the event loop, for the GIL, for new jobs). On the CPU
the "device time" is the host time of the forward and sampling sections, so the same figure measures the host
overhead between them.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("lorabatch.worker")

STAGES = ("fetch", "route", "queue", "engine", "publish", "ledger", "commit")
# A job's stamps take about 530 bytes while they wait for its offset's commit: 10,000 of them 5 MB. Without a bound, a
# broker that refused commits had every job billed since held here (40,000 jobs of a soak: 21 MB, and growing). Jobs
# wait for a commit legitimately behind a slow one in their partition: 10,000 is a minute of 160 jobs/s.
MAX_WAITING = 10_000


@dataclass(slots=True)
class Stamps:
    """One job's way through the worker, in monotonic ns (module docstring); 0: not reached yet."""

    key: tuple[str, str]  # (tenant_id, request_id)
    fetched: int
    parsed: int
    queued: int = 0
    started: int = 0
    served: int = 0
    published: int = 0
    billed: int = 0
    committed: int = 0

    def served_now(self, queue_us: int) -> None:
        """Its result is back: the first engine step was `queue_us` after it was queued (the engine's own count),
        kept within [queued, served] against the two clocks' microsecond rounding."""
        self.served = time.monotonic_ns()
        self.started = min(self.served, max(self.queued, self.queued + queue_us * 1000))

    def durations_ns(self) -> tuple[int, ...]:
        """The seven stages, in STAGES order."""
        t = (self.fetched, self.parsed, self.queued, self.started, self.served, self.published, self.billed, self.committed)
        return tuple(b - a for a, b in zip(t, t[1:]))


class StageLog:
    """Stamps of jobs whose row is written, waiting for their offset's commit; then observed, and kept if asked.
    `dropped`: a counter of the jobs billed while `max_waiting` stamps were held already (their commit stage unseen)."""

    def __init__(self, histogram=None, keep: int = 0, max_waiting: int = MAX_WAITING, dropped=None):
        assert max_waiting >= 1, max_waiting
        # One bound observe per stage: a label lookup per job and stage would cost more than the observation.
        self._observe: list[Callable[[float], None]] = [histogram.labels(s).observe for s in STAGES] if histogram is not None else []
        self._waiting: dict[object, list[tuple[int, int, Stamps]]] = {}  # partition -> heap of (offset, tie, stamps)
        self._held = 0  # stamps in `_waiting`
        self._tie = itertools.count()
        self.kept: deque[Stamps] = deque(maxlen=keep)
        self.done = 0  # jobs whose commit was stamped
        self.max_waiting = max_waiting
        self.dropped = 0  # jobs whose stamps were not held (`billed` past max_waiting)
        self._dropped_counter = dropped
        self._dropped_at_bound: int | None = None  # `dropped` when the bound was reached, while it is (said once)

    def billed(self, tp, offset: int, stamps: Stamps) -> None:
        """The job at (tp, offset) has its result published and its row written; its commit comes later."""
        stamps.billed = time.monotonic_ns()
        stamps.published = stamps.published or stamps.billed  # a result the broker refused for good: not sent at all
        if self._held >= self.max_waiting:
            self._drop(stamps)
            return
        heapq.heappush(self._waiting.setdefault(tp, []), (offset, next(self._tie), stamps))
        self._held += 1

    def _drop(self, stamps: Stamps) -> None:
        """Observe the six stages known, count the job, and say once that commits are not passing."""
        for observe, ns in zip(self._observe, stamps.durations_ns()[:-1]):
            observe(ns / 1e9)
        self.dropped += 1
        if self._dropped_counter is not None:
            self._dropped_counter.inc()
        if self._dropped_at_bound is None:
            self._dropped_at_bound = self.dropped - 1
            log.warning("offset commits have not passed %d billed jobs (the broker refuses commits, or the group keeps "
                        "rebalancing): the commit stage of jobs billed from now on is not observed in "
                        "lorabatch_stage_seconds (lorabatch_stage_records_dropped_total counts them); their offsets "
                        "commit when commits pass again, and nothing is billed twice or lost", self._held)

    def committed(self, offsets: dict) -> None:
        """Offsets committed (partition -> next offset to read): every job waiting below one is done."""
        now = time.monotonic_ns()
        for tp, upto in offsets.items():
            heap = self._waiting.get(tp)
            while heap and heap[0][0] < upto:
                s = heapq.heappop(heap)[2]
                self._held -= 1
                s.committed = now
                self.done += 1
                for observe, ns in zip(self._observe, s.durations_ns()):
                    observe(ns / 1e9)
                if self.kept.maxlen:
                    self.kept.append(s)
        self._below_bound()

    def _below_bound(self) -> None:
        # Back under half the bound: a commit that frees a few places while commits mostly fail says nothing.
        if self._dropped_at_bound is not None and self._held < self.max_waiting // 2:
            log.warning("jobs waiting for their offsets' commit are under half their bound again (commits passed, or "
                        "partitions were revoked): %d jobs' commit stage went unobserved meanwhile",
                        self.dropped - self._dropped_at_bound)
            self._dropped_at_bound = None

    def forget(self, partitions) -> None:
        """Partitions revoked: their jobs' offsets are no longer this worker's to commit."""
        for tp in partitions:
            self._held -= len(self._waiting.pop(tp, ()))
        self._below_bound()

    def waiting(self) -> int:
        return self._held


class EngineClock:
    """Wall time during which the engine held at least one of the worker's jobs, and its steps' device time meanwhile."""

    def __init__(self, clock: Callable[[], int] = time.monotonic_ns):
        self._clock = clock
        self._jobs = 0
        self._since = 0  # when the engine last went from no job to one
        self._occupied_ns = 0  # closed spans
        self.busy_us = 0  # device time of the steps drained since the last reset
        self.steps = 0
        self._window = (0, 0)  # (occupied ns, busy us) at the last `window_idle_share`

    def enter(self) -> None:
        if self._jobs == 0:
            self._since = self._clock()
        self._jobs += 1

    def leave(self) -> None:
        assert self._jobs > 0, "leave without enter"
        self._jobs -= 1
        if self._jobs == 0:
            self._occupied_ns += self._clock() - self._since

    def add_steps(self, busy_us: int, steps: int) -> None:
        self.busy_us += busy_us
        self.steps += steps

    def occupied_ns(self) -> int:
        return self._occupied_ns + (self._clock() - self._since if self._jobs else 0)

    def idle_share(self) -> float | None:
        """1 - device time / occupied time since the last reset (None before the engine held any job)."""
        return _idle(self.busy_us, self.occupied_ns())

    def window_idle_share(self) -> float | None:
        """The same over the time since the last call (the worker's gauge)."""
        occupied, busy = self.occupied_ns(), self.busy_us
        (occupied0, busy0), self._window = self._window, (occupied, busy)
        return _idle(busy - busy0, occupied - occupied0)

    def reset(self) -> None:
        self._occupied_ns = self.busy_us = self.steps = 0
        if self._jobs:
            self._since = self._clock()
        self._window = (0, 0)


def _idle(busy_us: int, occupied_ns: int) -> float | None:
    if occupied_ns <= 0:
        return None
    # Steps drained in a window may have begun in the one before (a decode round read back late): clamp at 0.
    return max(0.0, 1.0 - busy_us * 1000 / occupied_ns)


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile by nearest rank (0 for none)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def stage_summary(stamps: list[Stamps]) -> dict[str, dict[str, float]]:
    """stage -> {"p50_ms", "p99_ms"} over the jobs' stamps."""
    per_stage = list(zip(*(s.durations_ns() for s in stamps))) or [()] * len(STAGES)
    return {name: {"p50_ms": round(percentile(list(ns), 0.50) / 1e6, 3), "p99_ms": round(percentile(list(ns), 0.99) / 1e6, 3)}
            for name, ns in zip(STAGES, per_stage)}
