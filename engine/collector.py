"""The cyclic garbage collector's passes, run while the GPU has a decode round in flight.

CPython collects when allocations cross its thresholds (700 net container allocations for the young generation; a
generation-1 pass every 10 of those, a full pass every 10 of these), wherever that happens to be. In the step loop a
pass that falls on the host's critical path (launching a round, booking one) stalls the GPU behind it: issue 19's
2,000-adapter passes on an H100 had their slowest decode step with a load at 1.30x the median step, where the steps'
own device time was 1.03x, and the whole difference was one collection of 5.5-5.7 ms inside a call of 8 steps
(engine/PERF.md, session 21). Between launching a round and reading the one before it back, the host only waits for the
GPU: a pass there costs nothing but host time the step loop does not need.

`CollectorWindow` is called at that point (engine.Engine.step, decode rounds in flight). Once the young generation
has half its threshold of allocations pending, it runs now the pass the automatic collector would choose were it to
fire: the oldest generation whose count (young passes since the last generation-1 pass, generation-1 passes since the
last full one) is past its threshold. The counts restart after each, so the automatic collector, which fires only at
the young threshold, rarely fires elsewhere. It takes nothing over: thresholds, `gc.freeze` and
a disabled collector are left as they are (with the collector disabled, or a threshold of 0, the window does nothing).

The full pass is taken where its count comes due, without CPython's check that the objects that survived into the oldest
generation since the last full pass are at least a quarter of it (a check Python does not expose): on the engine's
passes that check held at every full pass the automatic collector came to (a CPU probe of the adapters bench: 6 full
passes to 61 generation-1 passes), so the window collects about as often, in time the GPU is busy anyway.
"""

from __future__ import annotations

import gc
import time

SHARE = 0.5  # of the young generation's threshold pending before the window collects


class CollectorWindow:
    """Runs the collector's next pass when called, where it comes due soon (module docstring); counts what it did."""

    def __init__(self, share: float = SHARE):
        assert 0.0 < share <= 1.0, share
        self.share = share
        self.passes = [0, 0, 0]  # passes run here, per generation
        self.ns = 0  # their time

    def __call__(self) -> int | None:
        """Collect now if a pass is due soon; the generation collected, or None."""
        if not gc.isenabled():
            return None
        t0, t1, t2 = gc.get_threshold()
        c0, c1, c2 = gc.get_count()
        if t0 <= 0 or c0 < t0 * self.share:
            return None
        # CPython's choice when its trigger fires: the oldest generation whose count is past its threshold
        generation = 2 if c2 > t2 else 1 if c1 > t1 else 0
        start = time.perf_counter_ns()
        gc.collect(generation)
        self.ns += time.perf_counter_ns() - start
        self.passes[generation] += 1
        return generation
