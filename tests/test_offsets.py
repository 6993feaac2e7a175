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


def test_redelivery_of_done_work_is_recognised():
    """A message fetched again after it finished (a rebalance replay) is reported as not new."""
    t = OffsetTracker()
    assert t.fetched("p", 3)
    t.finished("p", 3)
    assert not t.fetched("p", 3)
    assert t.fetched("p", 4)


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
