"""Adapter buckets: batches close on size, tokens or time, with bounded adapter mix."""

from consumer.buckets import AdapterBuckets, Pending


def _p(key, t=0.0, tokens=10, part="p0"):
    return Pending(key, tokens, t, payload=(key, t), partition=part)


def test_empty():
    b = AdapterBuckets(4, 1000, 50, 2)
    assert b.next_deadline(0.0) is None
    assert b.take_batch(0.0) == []
    assert len(b) == 0


def test_bucket_closes_when_full():
    """A full bucket is ready at once; a partial one waits for max_wait_ms."""
    b = AdapterBuckets(2, 1000, 50, 4)
    b.add(_p("a"))
    assert b.next_deadline(0.0) == 0.05
    assert b.take_batch(0.0) == []
    b.add(_p("a"))
    assert b.next_deadline(0.0) == 0.0
    assert [p.adapter_key for p in b.take_batch(0.0)] == ["a", "a"]


def test_bucket_closes_on_time_and_mixes_adapters_oldest_first():
    b = AdapterBuckets(8, 1000, 50, 2)
    b.add(_p("b", t=0.01))
    b.add(_p("a", t=0.0))
    b.add(_p("c", t=0.02))
    batch = b.take_batch(0.1)
    assert [p.adapter_key for p in batch] == ["a", "b"]  # at most 2 adapters, oldest buckets first
    assert [p.adapter_key for p in b.take_batch(0.1)] == ["c"]


def test_token_budget_splits_a_bucket():
    b = AdapterBuckets(8, 25, 0, 4)
    for _ in range(3):
        b.add(_p(None, tokens=10))
    assert len(b.take_batch(1.0)) == 2
    assert len(b.take_batch(1.0)) == 1


def test_oversized_single_job_still_runs():
    """A job over the token budget alone forms a batch of one rather than waiting forever."""
    b = AdapterBuckets(8, 5, 0, 4)
    b.add(_p("a", tokens=50))
    assert len(b.take_batch(1.0)) == 1


def test_drop_revoked_partitions():
    b = AdapterBuckets(8, 1000, 50, 4)
    b.add(_p("a", part="p0"))
    b.add(_p("a", part="p1"))
    b.add(_p("b", part="p1"))
    dropped = b.drop({"p1"})
    assert len(dropped) == 2 and len(b) == 1
    assert b.queued_by_adapter() == {"a": 1}
