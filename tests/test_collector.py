"""The garbage collector's window between rounds (engine.collector): when it collects, which generation, and that a
step loop calling it leaves the automatic collector nothing to do.

Each test sets its own thresholds (restored after), and counts start from a full collection. Allocations are lists
kept alive (each a tracked container: one count of the young generation), far from the thresholds' edges, so that
other threads of the test process do not move a count across one.
"""

from __future__ import annotations

import gc

import pytest

from engine.collector import CollectorWindow


@pytest.fixture
def thresholds():
    saved, enabled = gc.get_threshold(), gc.isenabled()

    def set_(*t: int) -> None:
        gc.set_threshold(*t)
        gc.collect()  # every count back to 0

    yield set_
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def _allocate(n: int) -> list:
    return [[] for _ in range(n)]


def test_nothing_is_collected_below_half_the_young_threshold(thresholds):
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    keep = _allocate(3_000)
    assert window() is None and window.passes == [0, 0, 0]
    assert gc.get_count()[0] >= 3_000, "the window collected though nothing was due"
    del keep


def test_the_young_generation_is_collected_once_half_its_threshold_is_pending(thresholds):
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    keep = _allocate(6_000)
    assert window() == 0 and window.passes == [1, 0, 0] and window.ns > 0
    c0, c1, _ = gc.get_count()
    assert c0 < 1_000 and c1 == 1, gc.get_count()  # the young count restarted; generation 1 counts one young pass
    del keep


def test_it_collects_the_generation_cpython_would_choose(thresholds):
    """The oldest generation whose count is past its threshold: generation 1 after 11 young passes (threshold 10),
    a full pass after 11 generation-1 passes, as CPython's trigger would choose."""
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    for _ in range(10):
        gc.collect(0)
    keep = _allocate(6_000)
    assert gc.get_count()[1] == 10 and window() == 0  # 10 is not past 10
    for _ in range(11):
        gc.collect(0)
    keep += _allocate(6_000)
    assert window() == 1 and gc.get_count()[1] == 0 and gc.get_count()[2] == 1
    for _ in range(11):
        gc.collect(1)
    keep += _allocate(6_000)
    assert window() == 2 and gc.get_count()[1:] == (0, 0)
    assert window.passes == [1, 1, 1]
    del keep


def test_a_disabled_collector_or_a_zero_threshold_is_left_alone(thresholds):
    thresholds(10_000, 10, 10)
    window = CollectorWindow()
    keep = _allocate(6_000)
    gc.disable()
    assert window() is None and gc.get_count()[0] >= 6_000
    gc.enable()
    gc.set_threshold(0, 10, 10)  # CPython's way of turning automatic collection off
    assert window() is None and window.passes == [0, 0, 0]
    del keep


def test_a_step_loop_calling_it_leaves_the_automatic_collector_nothing(thresholds):
    """Up to half the young threshold allocated between two windows (a step's garbage, cycles included): every pass
    runs in a window, none where the allocations happen."""
    thresholds(10_000, 3, 3)
    window = CollectorWindow()
    outside, inside = [], [False]

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and not inside[0]:
            outside.append(info["generation"])

    gc.callbacks.append(seen)
    try:
        for step in range(60):
            garbage = _allocate(2_000 + 1_000 * (step % 4))  # 2,000-5,000 a step
            for a, b in zip(garbage[::2], garbage[1::2]):
                a.append(b)
                b.append(a)  # cycles: only the collector frees them
            del garbage
            inside[0] = True
            try:
                window()
            finally:
                inside[0] = False
    finally:
        gc.callbacks.remove(seen)
    assert outside == [], f"automatic passes outside the window: {outside}"
    assert window.passes[0] > 0 and window.passes[1] > 0 and window.passes[2] > 0, window.passes


def test_the_share_is_checked():
    with pytest.raises(AssertionError):
        CollectorWindow(share=0)
    with pytest.raises(AssertionError):
        CollectorWindow(share=1.5)
