"""The cyclic garbage collector's passes, run while the GPU has a decode round in flight.

CPython collects when its young generation's count (net container allocations) passes its threshold (700), wherever
that happens to be: a young pass, or a generation-1 pass once more than 10 young passes have run since the last one, or
a full pass once more than 10 generation-1 passes have, if the oldest generation grew by a quarter since its last full
pass. In the step loop a pass that falls on the host's critical path (launching a round, booking one) stalls the GPU
behind it: issue 19's 2,000-adapter passes on an H100 had their slowest decode call with a load at 1.29-1.30x the
median step where the steps' own device time was 1.03x, and the difference was one collection of 5.5-5.7 ms inside a
call of 8 steps (engine/PERF.md, session 21).

`CollectorWindow` is called once a round is launched and before the host reads a round back (engine.Engine.step, and
`_run` after it launches a round): the GPU has work queued then, and the host would otherwise wait for it sooner. It
runs a pass there when the automatic collector would otherwise fire before the next call: when the young count plus
the most it has risen between two calls lately (`rise`, decaying) passes the threshold. The automatic collector then
rarely fires elsewhere, and the window collects about as often as it would (a pass a little early, never more than one
a call). The generation is the one CPython's trigger would choose (the oldest whose count is past its threshold),
except the full pass: CPython also checks that the oldest generation grew by a quarter, which Python does not expose
(after `gc.freeze`, whose objects count as its size, it skips full passes for long), so the window takes generation 1
instead and a full pass only once FULL_AFTER times generation 2's threshold of generation-1 passes have run since the
last one: cyclic garbage that reached the oldest generation is freed late, not never.

Bursts. A call whose host work allocates more than the threshold (a load-ahead placing 40-60 adapters) started the
automatic collector inside it whatever the window had done, and there CPython's own choice could be a full pass: in
session 22's calls on an H100 the slowest decode calls with a load held one pass of 5.7-6.3 ms each (the window's own
averaged 0.17 ms), in calls whose host work already filled the round. The engine runs a round's load-ahead and then
the window inside `deferred` (the window also when the load-ahead raised), so that such a burst is collected by the
window's choice of generation. A prompt step's load-ahead runs as before, with no window after it.

Not hidden everywhere: the call's other host work (placing adapters) runs in the same gap, and a pass that outlasts the
GPU's queued work delays the step. Session 21's A/B (an earlier version that collected at half the threshold and took
full passes when due) left the p99 of the slowest decode calls as it was and raised host-warm throughput by 1-2 points.
A full pass is the long one (6-9 ms at 2,000 adapters, against 0.1-0.8 ms for the others), and CPython's own came where
the window could not see them: with generation 2 kept past its threshold by the window's generation-1 passes, any
automatic pass (a burst while booking a round, in the caller's loop) was a full one once CPython's quarter check let it
(a 9.2 ms pass in an 8-step call with a load, an H100, session 26). The engine now tells the window when its work under
the round should end: a full pass that fits before then is taken as soon as generation 2 passes its threshold, which
leaves the automatic collector none to choose, and one due by FULL_AFTER that does not fit waits for a round with room
(`__call__`'s `until_ns`).

Full passes held. That was not enough: a full pass fits few rounds once their placements are under way, so with the
window waiting for room, generation 2 stayed past its threshold and CPython took the pass itself. On an H100 (session
27) the window ran no full pass in either new run, and an automatic one of 22 ms fell in a host-warm 8-step call, the
slowest decode call with a load of that run. A process whose step loop calls the window (the engine process, the
adapters bench) can hand full passes to it (`hold_full_passes`): generation 2's threshold is raised to HELD_FACTOR
times its own, so CPython's trigger picks no full pass before the window has had its chances: the window takes one where
it fits once generation 2 passes its own threshold, or, where none fits, once twice FULL_AFTER's generation-1 passes have
run, wherever that falls. Where no window is called (an engine with no decode rounds to run, a window whose young-count
test keeps it from looking), CPython takes the full pass itself a little later, so cyclic garbage is still freed. The
engine process holds them only where decode rounds can run (CUDA graphs).

Freezes. A full pass's time depends on what `gc.freeze` set aside, so the window forgets the last one's time when objects
are frozen or thawed. It learns of that through this module's `freeze` and `unfreeze`, which the engine process and the
benches call, not through `gc.get_freeze_count`: CPython 3.11-3.13 count the frozen objects by walking their list, 20-40
ms at 2,000 adapters on an H200's host with every record frozen, and the window called it at every pass it ran (issue
19's slowest decode calls: 8-step rounds whose window took 20-37 ms with under 1.5 ms of it collecting, engine/PERF.md,
session 30). A `gc.freeze` made elsewhere goes unseen: the window keeps the last full pass's time until the next one.

Left alone: a disabled collector or a threshold of 0 (the window does nothing), and Pythons
whose collector is not CPython 3.11-3.13's three generations (3.14's incremental collector, free-threaded builds): there
the window does nothing and the automatic collector runs as it does. Not handled: another thread that disables the
collector while `deferred` has it off finds it on again when the body ends (the step loop's process runs no such
thread).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import sysconfig
import time
from collections.abc import Iterator

FULL_AFTER = 10  # a full pass once this many times the third threshold of generation-1 passes have run since the last
# A full pass's time before one ran here since the last `freeze` or `unfreeze` (which change what a full pass walks: 78 ms
# in the 2,000-adapter bench's warm-up on an H200, 6-7 ms after its freeze; the longest seen after one: 9.2 ms, an H100)
FULL_GUESS_NS = 10_000_000
DECAY = 0.9  # of `rise` per call: a burst of allocations is remembered for a few dozen calls
GENERATIONAL = sys.version_info < (3, 14) and not sysconfig.get_config_var("Py_GIL_DISABLED")
# While full passes are held for the windows, generation 2's threshold is this many times its own: CPython's trigger takes
# a full pass only past the point where a window forces one (2 x FULL_AFTER), a backstop where no window is called
HELD_FACTOR = 2 * FULL_AFTER + 1
_held: tuple[int, int] | None = None  # (generation 2's own threshold, the one set) while held (`hold_full_passes`)
_freezes = 0  # calls of `freeze` and `unfreeze` so far (module docstring, "Freezes")


def freeze() -> None:
    """gc.freeze, told to the windows: their last full pass's time no longer says what the next one walks."""
    global _freezes
    gc.freeze()
    _freezes += 1


def unfreeze() -> None:
    """gc.unfreeze, told to the windows as `freeze` is."""
    global _freezes
    gc.unfreeze()
    _freezes += 1


def hold_full_passes() -> bool:
    """Leave full passes of this process to its windows (module docstring, "Full passes held"): generation 2's threshold
    goes to HELD_FACTOR times its own, and the windows keep deciding by their own. For a process whose step loop calls
    a window; True if held (now or before), False where the window does nothing or the thresholds leave nothing to hold.
    One holder a process: `release_full_passes` gives them back whoever held them."""
    global _held
    if _held is not None:
        return True
    t0, t1, t2 = gc.get_threshold()
    if not GENERATIONAL or t0 <= 0 or t2 <= 0:
        return False
    _held = (t2, t2 * HELD_FACTOR)
    gc.set_threshold(t0, t1, _held[1])
    return True


def release_full_passes() -> None:
    """Give full passes back to CPython's trigger, at the threshold generation 2 had (unless it was set again since)."""
    global _held
    if _held is None:
        return
    t0, t1, t2 = gc.get_threshold()
    if t2 == _held[1]:
        gc.set_threshold(t0, t1, _held[0])
    _held = None


def _own_t2(t2: int) -> int:
    """Generation 2's threshold as the windows decide by it: its own while full passes are held for them."""
    return _held[0] if _held is not None and t2 == _held[1] else t2


class CollectorWindow:
    """Runs the collector's next pass when called, where the automatic collector would fire before the next call
    (module docstring); counts what it did."""

    def __init__(self, rise: float | None = None):
        self.rise = rise  # the young count's recent largest rise between calls; None: half the threshold until measured
        self._last = 0  # the young count when the last call returned
        self.passes = [0, 0, 0]  # passes run here, per generation
        self.ns = 0  # their time
        self.full_ns: int | None = None  # the last full pass's time (None: none ran here yet)
        self.full_put_off = 0  # calls that put a due full pass off, short of the round's end (`__call__`)
        self._frozen = _freezes  # the freezes and thaws before `full_ns` was measured (module docstring, "Freezes")
        self._holding = False  # inside `deferred`: the collector is off for the window's sake, not the caller's

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """The automatic collector held off while the body runs, where a burst of allocations (a load-ahead placing
        dozens of adapters) would start a pass in the middle of it, of whatever generation CPython picks; the body calls
        the window last, which collects what it left before the collector is on again (module docstring, "Bursts"): on
        again with the young count past its threshold, the next allocation would start the automatic pass. Nothing
        where the window does nothing, or the collector is disabled already."""
        if not GENERATIONAL or not gc.isenabled():
            yield
            return
        gc.disable()
        self._holding = True
        try:
            yield
        finally:
            self._holding = False
            gc.enable()

    def __call__(self, until_ns: int | None = None) -> int | None:
        """Collect now if the automatic collector would fire before the next call; the generation collected, or None.

        `until_ns` (time.perf_counter_ns): when the host's work under the round in flight should end (the engine's
        reckoning). Where a full pass could be CPython's next choice (generation 2 past its threshold) and it fits before
        then, at the last full pass's time (FULL_GUESS_NS before one ran here), the window takes it: an automatic pass
        elsewhere then finds generation 2 under its threshold and stays young. A full pass due by FULL_AFTER that does
        not fit is put off, generation 1 collected instead, until a round has room for it or twice FULL_AFTER's passes
        have run (`full_put_off` counts the calls that put it off). Without `until_ns`, full passes come by FULL_AFTER."""
        if not GENERATIONAL or not (self._holding or gc.isenabled()):
            return None
        t0, t1, t2 = gc.get_threshold()
        t2 = _own_t2(t2)  # (full passes held for the windows: by generation 2's own threshold)
        c0, c1, c2 = gc.get_count()
        if t0 <= 0:
            return None
        rise = c0 - self._last
        self.rise = max(rise, (t0 / 2 if self.rise is None else self.rise) * DECAY)
        self._last = c0
        if c0 + self.rise <= t0:
            return None
        if _freezes != self._frozen:  # objects frozen or thawed since the last full pass: its time says nothing
            self.full_ns, self._frozen = None, _freezes
        start = time.perf_counter_ns()
        fits = until_ns is not None and start + (self.full_ns or FULL_GUESS_NS) <= until_ns
        generation = 1 if c1 > t1 else 0
        if c2 > t2 * FULL_AFTER:
            if until_ns is None or fits or c2 > 2 * t2 * FULL_AFTER:
                generation = 2
            else:
                generation = 1
                self.full_put_off += 1
        elif c2 > t2 and fits:
            generation = 2
        gc.collect(generation)
        took = time.perf_counter_ns() - start
        self.ns += took
        if generation == 2:
            self.full_ns = took
        self.passes[generation] += 1
        self._last = gc.get_count()[0]
        return generation
