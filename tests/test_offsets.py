"""Offsets: only the highest contiguous finished offset is ever committed."""

import pytest

from consumer.offsets import OffsetTracker


@pytest.mark.parametrize(
    ("fetched", "finished", "expect"),
    [
        ([], [], {}),
        ([5, 6, 7], [], {}),
        ([5, 6, 7], [5], {"p": 6}),
        ([5, 6, 7], [5, 7], {"p": 6}),  # 6 still pending: 7 must not be committed
        ([5, 6, 7], [7, 6, 5], {"p": 8}),
        ([0], [0], {"p": 1}),
    ],
)
def test_commit_is_contiguous(fetched, finished, expect):
    """The committable offset is one past the last finished offset with nothing pending below it."""
    t = OffsetTracker()
    for o in fetched:
        t.fetched("p", o)
    for o in finished:
        t.finished("p", o)
    assert t.committable() == expect


def test_position_going_back_starts_a_new_epoch():
    """An offset at or below one already fetched means the log was reset: the old marks are dropped, the
    new log's offsets are tracked (and committed) from where it was read, and the old epoch's outcomes
    no longer move the marks."""
    t = OffsetTracker()
    old = t.fetched("p", 100)
    t.fetched("p", 101)
    t.finished("p", 100, old)
    t.mark_committed(t.committable())
    assert t.confirmed("p") == 101
    new = t.fetched("p", 0)  # a restarted broker's empty log, read from the beginning
    assert new != old
    assert t.confirmed("p") is None
    t.finished("p", 101, old)  # the old log's last job finishes: it must not count in the new log
    assert t.committable() == {"p": 0}
    t.finished("p", 0, new)
    assert t.committable() == {"p": 1}
    assert t.in_flight() == 0


@pytest.mark.parametrize("offsets", [[3, 3], [5, 6, 2], [0, 1, 1]])
def test_no_offset_is_skipped_after_a_reset(offsets):
    """Whatever order the log hands offsets in, every fetched message is tracked as pending: none is
    taken for a redelivery and silently skipped (the worker answers true repeats by request identity)."""
    t = OffsetTracker()
    epochs = [t.fetched("p", o) for o in offsets]
    t.finished("p", offsets[-1], epochs[-1])
    assert t.committable() == {"p": offsets[-1] + 1}


def test_reset_marks_commit_the_new_position():
    """After a reset, the new log's read position is committed even before anything finishes, so the broker
    learns it (the old committed offset may not exist in the new log)."""
    t = OffsetTracker()
    t.fetched("p", 50)
    t.reset("p")
    t.fetched("p", 0)
    assert t.committable() == {"p": 0}


def test_committed_offsets_are_not_recommitted():
    t = OffsetTracker()
    t.fetched("p", 0)
    t.finished("p", 0)
    t.mark_committed(t.committable())
    assert t.committable() == {}


def test_forget_drops_revoked_partitions():
    """Revoked partitions drop their pending work; finishing it later changes nothing."""
    t = OffsetTracker()
    t.fetched("a", 0)
    t.fetched("b", 0)
    t.forget(["a"])
    t.finished("a", 0)
    t.finished("b", 0)
    assert t.committable() == {"b": 1}
    assert t.in_flight() == 0


def test_a_revoke_keeps_what_was_left_and_committed():
    """Forgetting revoked partitions counts their pending offsets as left to the next owner and keeps this worker's
    last commit in each; a partition never committed here is not listed."""
    t = OffsetTracker()
    for tp in ("p0", "p1", "p2"):
        for o in range(3):
            t.fetched(tp, o)
    t.finished("p0", 0)
    t.finished("p1", 0)
    t.mark_committed(t.committable())  # p0=1, p1=1
    t.finished("p1", 1)
    t.forget(["p0", "p2", "gone"])
    assert t.left_on_revoke == 2 + 3
    assert t.committed_here() == {"p0": 1, "p1": 1}
    t.mark_committed(t.committable())  # p1=2
    assert t.committed_here() == {"p0": 1, "p1": 2}
    assert t.in_flight() == 1
