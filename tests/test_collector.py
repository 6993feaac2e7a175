"""The garbage collector's window between rounds (engine.collector): when it collects, which generation, and that a
step loop calling it leaves the automatic collector nothing to do while collecting about as often as it would.

Each test sets its own thresholds (restored after), and counts start from a full collection. Allocations are lists
kept alive (each a tracked container: one count of the young generation), far from the thresholds' edges, so that
other threads of the test process do not move a count across one.
"""

from __future__ import annotations

import gc
import time

import pytest

import engine.collector as collector
from engine.collector import FULL_AFTER, CollectorWindow


@pytest.fixture
def thresholds():
    saved, enabled = gc.get_threshold(), gc.isenabled()

    def set_(*t: int) -> None:
        gc.set_threshold(*t)
        gc.collect()  # every count back to 0

    yield set_
    collector.release_full_passes()  # (a test that held them and failed before giving them back)
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def _allocate(n: int) -> list:
    return [[] for _ in range(n)]


def test_nothing_is_collected_while_the_next_rise_stays_below_the_threshold(thresholds):
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    keep = _allocate(3_000)  # a rise of 3,000: 6,000 is still below 10,000
    assert window() is None and window.passes == [0, 0, 0] and window.rise >= 3_000
    assert gc.get_count()[0] >= 3_000, "the window collected though nothing was due"
    del keep


def test_a_pass_runs_where_the_next_rise_would_cross_the_threshold(thresholds):
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    keep = _allocate(3_000)
    assert window() is None
    keep += _allocate(3_000)  # 6,000 pending and rises of 3,000: the automatic collector could fire before the next call
    assert window() == 0 and window.passes == [1, 0, 0] and window.ns > 0
    c0, c1, _ = gc.get_count()
    assert c0 < 1_000 and c1 == 1, gc.get_count()  # the young count restarted; generation 1 counts one young pass
    del keep


def test_the_rise_it_expects_decays(thresholds):
    """A burst of allocations between two calls is remembered, less at each call: quiet calls later, the window no
    longer collects far from the threshold."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=9_000)
    keep = _allocate(2_000)
    assert window() == 0  # 2,000 + 9,000 past 10,000
    for _ in range(40):
        window()
    assert window.rise < 200, window.rise
    keep += _allocate(2_000)
    assert window() is None, "a burst forty calls ago still counted in full"
    del keep


def test_it_collects_the_generation_cpython_would_choose_but_full_passes_late(thresholds):
    """Generation 1 after more than 10 young passes (threshold 10), as CPython's trigger chooses; past generation 2's
    threshold still generation 1 (CPython's growth check, which Python does not expose, could skip the full pass), and
    a full pass once more than FULL_AFTER x 10 generation-1 passes ran since the last."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=10**9)  # due at every call
    for _ in range(10):
        gc.collect(0)
    keep = _allocate(10)
    assert gc.get_count()[1] == 10 and window() == 0  # 10 is not past 10
    for _ in range(11):
        gc.collect(0)
    assert window() == 1 and gc.get_count()[1] == 0 and gc.get_count()[2] == 1
    for _ in range(11):
        gc.collect(1)
    assert gc.get_count()[2] == 12 and window() == 0  # generation 2 past its threshold, generation 1 not: young
    for _ in range(11):
        gc.collect(0)
    assert window() == 1 and gc.get_count()[2] == 13  # not full: generation 1 instead
    for _ in range(FULL_AFTER * 10 - 12):
        gc.collect(1)
    assert gc.get_count()[2] == FULL_AFTER * 10 + 1 and window() == 2 and gc.get_count()[1:] == (0, 0)
    assert window.passes == [2, 2, 1]
    del keep


def test_a_disabled_collector_a_zero_threshold_or_another_collector_is_left_alone(thresholds, monkeypatch):
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=10**9)
    keep = _allocate(100)
    gc.disable()
    assert window() is None and gc.get_count()[0] >= 100
    gc.enable()
    gc.set_threshold(0, 10, 10)  # CPython's way of turning automatic collection off
    assert window() is None
    gc.set_threshold(10_000, 10, 10)
    monkeypatch.setattr(collector, "GENERATIONAL", False)  # 3.14's incremental collector, a free-threaded build
    assert window() is None and window.passes == [0, 0, 0]
    del keep


def _step_loop(window: CollectorWindow | None, steps: int = 60) -> tuple[list[int], int]:
    """(the generations of passes that started outside the window, passes in all) over `steps` steps of 2,000-4,000
    allocations in cycles, the window called after each."""
    outside, inside, total = [], [False], [0]

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            total[0] += 1
            if not inside[0]:
                outside.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        for step in range(steps):
            garbage = _allocate(2_000 + 1_000 * (step % 3))
            for a, b in zip(garbage[::2], garbage[1::2]):
                a.append(b)
                b.append(a)  # cycles: only the collector frees them
            del garbage
            if window is not None:
                inside[0] = True
                try:
                    window()
                finally:
                    inside[0] = False
    finally:
        gc.callbacks.remove(seen)
    return outside, total[0]


def test_a_step_loop_calling_it_leaves_the_automatic_collector_nothing(thresholds):
    """Every pass runs in a window, none where the allocations happen, and about as many passes as the automatic
    collector alone runs over the same steps."""
    thresholds(10_000, 3, 3)
    _, automatic = _step_loop(None)
    thresholds(10_000, 3, 3)
    window = CollectorWindow()
    outside, total = _step_loop(window)
    assert outside == [], f"automatic passes outside the window: {outside}"
    assert window.passes[0] > 0 and window.passes[1] > 0, window.passes
    assert automatic <= total <= 1.5 * automatic + 1, (total, automatic)


def test_a_burst_deferred_is_collected_by_the_window_not_the_automatic_collector(thresholds):
    """A burst of several thresholds' worth of allocations inside `deferred` starts no pass; the window called last in it
    collects it, once, before the collector is on again; a collector disabled before stays disabled, and an exception
    turns it on again."""
    thresholds(700, 10, 10)
    window = CollectorWindow(rise=0)
    starts = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            starts.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        with window.deferred():
            assert not gc.isenabled()
            keep = _allocate(5_000)
            assert starts == [] and gc.get_count()[0] >= 5_000, starts
            assert window() == 0 and starts == [0]  # the window's own pass, the collector still held off
        assert gc.isenabled() and gc.get_count()[0] < 700
        more = _allocate(100)
        assert starts == [0], starts  # nothing left past the threshold for the automatic collector
        with window.deferred():
            pass  # a window not called: the collector is on again all the same
        assert gc.isenabled()
        gc.disable()
        with window.deferred():
            pass
        assert not gc.isenabled()
        gc.enable()
        with pytest.raises(RuntimeError), window.deferred():
            raise RuntimeError("a load-ahead that raises")
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(seen)
    del keep, more


def test_a_full_pass_runs_where_the_round_has_room_for_it_and_waits_where_it_has_none(thresholds, monkeypatch):
    """With the round's end given: generation 2 just past its threshold gets a full pass where one fits (at the last
    one's time, FULL_GUESS_NS before any), the generation CPython's trigger would take otherwise where none does; a full pass due by FULL_AFTER that does not
    fit is put off (counted) until twice FULL_AFTER's passes ran. Without an end, full passes come by FULL_AFTER only."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=10**9)
    keep = _allocate(10)
    now = 10**15
    monkeypatch.setattr(collector.time, "perf_counter_ns", lambda: now)

    def past(n: int) -> None:  # generation 2's count to n + 1 (each gc.collect(1) adds one)
        gc.collect(2)
        for _ in range(n + 1):
            gc.collect(1)

    past(10)
    assert window(until_ns=now + collector.FULL_GUESS_NS - 1) == 0  # no full pass timed: the guess does not fit (young)
    assert window.full_put_off == 0  # (not due by FULL_AFTER: nothing put off)
    past(10)
    assert window(until_ns=now + collector.FULL_GUESS_NS) == 2 and gc.get_count()[2] == 0
    window.full_ns = 5_000_000  # (the fake clock timed the pass at 0)
    past(10)
    assert window(until_ns=now + 4_000_000) == 0 and window(until_ns=now + 5_000_000) == 2
    past(FULL_AFTER * 10)
    window.full_ns = 5_000_000
    assert window(until_ns=now + 4_000_000) == 1 and window.full_put_off == 1  # due, no room: put off
    past(2 * FULL_AFTER * 10)
    assert window(until_ns=now) == 2  # put off long enough: it runs
    past(FULL_AFTER * 10 - 1)
    assert window() == 0  # no end given: no full pass until FULL_AFTER's passes
    past(FULL_AFTER * 10)
    assert window() == 2
    del keep


def test_a_freeze_forgets_the_last_full_pass_time(thresholds, monkeypatch):
    """A full pass timed before gc.freeze (which sets most objects aside) does not bar the cheaper ones after it."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=10**9)
    keep = _allocate(10)
    now = 10**15
    monkeypatch.setattr(collector.time, "perf_counter_ns", lambda: now)
    window.full_ns = 80_000_000  # timed with everything in the oldest generation
    for _ in range(12):
        gc.collect(1)
    assert window(until_ns=now + collector.FULL_GUESS_NS) == 0  # 80 ms does not fit in 10
    collector.freeze()
    try:
        for _ in range(12):
            gc.collect(1)
        assert window(until_ns=now + collector.FULL_GUESS_NS) == 2  # forgotten: the guess fits
        window.full_ns = 80_000_000
        for _ in range(12):
            gc.collect(1)
        assert window(until_ns=now + collector.FULL_GUESS_NS) == 0  # no freeze since: the time it measured stands
    finally:
        collector.unfreeze()
    for _ in range(12):
        gc.collect(1)
    assert window(until_ns=now + collector.FULL_GUESS_NS) == 2  # a thaw is told too
    del keep


@pytest.mark.skipif(not collector.GENERATIONAL, reason="CPython 3.11-3.13's three generations")
def test_the_window_never_counts_the_frozen_objects(thresholds, monkeypatch):
    """gc.get_freeze_count walks every frozen object (20-40 ms with a 2,000-adapter engine frozen): the window, called
    every round, learns of freezes from engine.collector's own freeze and unfreeze instead."""
    thresholds(10_000, 10, 10)

    def walks() -> int:
        raise AssertionError("gc.get_freeze_count walks every frozen object")

    monkeypatch.setattr(collector.gc, "get_freeze_count", walks)
    window = CollectorWindow(rise=10**9)
    keep = _allocate(10)
    collector.freeze()
    try:
        for _ in range(12):
            gc.collect(1)
        assert window(until_ns=time.perf_counter_ns() + 10**12) == 2 and window() is not None
    finally:
        collector.unfreeze()
    del keep


@pytest.mark.skipif(not collector.GENERATIONAL, reason="CPython 3.11-3.13's three generations")
def test_full_passes_held_are_the_windows_first(thresholds, monkeypatch):
    """With full passes held (the engine process's way, where decode rounds run): CPython's own trigger picks no full
    pass before the window has had its chances, while the window decides by generation 2's own threshold: a full pass
    where the round has room for one, else once twice FULL_AFTER's generation-1 passes have run. Past that, where no
    window looked, CPython's trigger takes it (a backstop). Released, the threshold is the one it was."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow(rise=10**9)
    keep = _allocate(10)
    now = 10**15
    monkeypatch.setattr(collector.time, "perf_counter_ns", lambda: now)
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    assert collector.hold_full_passes() and collector.hold_full_passes()  # twice: still held, once
    gc.freeze()  # the oldest generation empty: CPython's quarter check then passes, its trigger would take a full pass
    gc.callbacks.append(seen)
    try:
        assert gc.get_threshold() == (10_000, 10, 10 * collector.HELD_FACTOR)
        gc.collect(2)
        full.clear()
        keep += _allocate(10)  # young, to reach the oldest generation through the passes below
        for _ in range(40):  # generation 2 four times past its own threshold: CPython's trigger would take a full pass
            gc.collect(1)
        more = _allocate(25_000)  # over 2 young thresholds' worth: automatic passes, none of them full
        assert not full and gc.get_count()[2] > 10
        assert window(until_ns=now + collector.FULL_GUESS_NS - 1) in (0, 1)  # no room: a young pass
        assert window(until_ns=now + collector.FULL_GUESS_NS) == 2 and gc.get_count()[2] == 0  # room: the full pass
        for _ in range(2 * FULL_AFTER * 10 + 1):
            gc.collect(1)
        del more  # (the oldest generation small again: the quarter check below looks at what reached it since)
        assert window(until_ns=now) == 2  # none had room for long: it runs anyway
        full.clear()
        keep += _allocate(1_000)
        for _ in range(10 * collector.HELD_FACTOR + 1):  # and where no window looks, CPython's own comes after all
            gc.collect(1)
        more = _allocate(25_000)
        assert full
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
        collector.release_full_passes()
    assert gc.get_threshold() == (10_000, 10, 10)
    collector.release_full_passes()  # nothing held: nothing changes
    assert gc.get_threshold() == (10_000, 10, 10)
    del keep, more
