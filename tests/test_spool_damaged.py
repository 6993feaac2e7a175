"""A spool file damaged while the worker runs (truncated, overwritten) is set aside for salvage and a new one made at
its path: the worker goes on spooling and flushing, and no call raises. Before, every spool call raised "database disk
image is malformed": the flusher's pass ended its task, and the fetch loop's look at the spool's size the worker."""

from __future__ import annotations

import asyncio
import os
from datetime import UTC, datetime

import pytest

from billing.records import UsageRecord
from consumer.delivery import Deliverer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.spool import Spool

NOW = datetime.now(UTC)


def _usage(i: int) -> UsageRecord:
    return UsageRecord(tenant_id="acme", request_id=f"r{i}", status="succeeded", created_at=NOW, base_us=1000 + i,
                       worker_id="w1", result_json="x" * 2000)


def _damage(spool: Spool, how: str) -> None:
    """Damage the file under the open spool, its cache made too small to hide it (as a spool of many records is)."""
    spool._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    spool._db.execute("PRAGMA cache_size=1")
    if how == "truncated":
        os.truncate(spool.path, 0)
    else:
        with open(spool.path, "r+b") as f:
            f.seek(4096)
            f.write(os.urandom(os.path.getsize(spool.path) - 4096))


class Ledger:
    def __init__(self):
        self.rows: dict[tuple[str, str], UsageRecord] = {}

    def record_usage(self, records):
        new = [r for r in records if (r.tenant_id, r.request_id) not in self.rows]
        self.rows.update({(r.tenant_id, r.request_id): r for r in records})
        return len(new)


@pytest.mark.parametrize("how", ["truncated", "overwritten"])
def test_a_damaged_spool_is_set_aside_and_a_new_one_takes_records(tmp_path, how, caplog) -> None:
    """Every call answers after the damage; the damaged file is kept beside, named in an error line with `.recover`."""
    spool = Spool(tmp_path / "w.sqlite", max_records=1000)
    try:
        spool.put([_usage(i) for i in range(50)])
        _damage(spool, how)
        assert not spool.full
        assert len(spool) == 0 and spool.oldest(10) == ("", [], [])
        spool.put([_usage(99)])
        assert len(spool) == 1 and spool.usage([("acme", "r99")])
        spool.remove([1])
        aside = [p.name for p in tmp_path.iterdir() if ".damaged-" in p.name]
        assert any(n.startswith("w.sqlite.damaged-") and n[-4:].isdigit() for n in aside), aside
        assert "is damaged" in caplog.text and ".recover" in caplog.text
    finally:
        spool.close()
    reopened = Spool(tmp_path / "w.sqlite", max_records=1000)  # the new file opens at the next start
    assert len(reopened) == 0
    reopened.close()


async def test_the_flusher_goes_on_over_a_damaged_spool(tmp_path) -> None:
    """A flush over a damaged spool returns (no exception ends the flusher task), and records spooled after it are
    flushed once each."""
    spool = Spool(tmp_path / "w.sqlite", max_records=1000)
    ledger = Ledger()
    d = Deliverer(None, None, ledger, OffsetTracker(), WorkerMetrics(), "w1", lambda t: True, spool, flush_s=0.01)  # type: ignore[arg-type]
    try:
        spool.put([_usage(i) for i in range(50)])
        _damage(spool, "overwritten")
        assert await d.flush_once() > 0
        await asyncio.to_thread(spool.put, [_usage(100), _usage(101)])
        await d.flush_once()
        assert sorted(ledger.rows) == [("acme", "r100"), ("acme", "r101")] and len(spool) == 0
        assert d.ledger_down is None
    finally:
        spool.close()


async def test_a_spool_that_cannot_be_emptied_is_not_the_ledger_down(tmp_path, monkeypatch, caplog) -> None:
    """Records written to the ledger whose removal from the spool fails (its disk full) stay spooled and are written
    again later, once each in the ledger; the ledger is not said down for it (it said "the ledger is unavailable
    (database or disk is full)" and set lorabatch_ledger_up to 0)."""
    import sqlite3
    spool = Spool(tmp_path / "w.sqlite", max_records=1000)
    ledger = Ledger()
    d = Deliverer(None, None, ledger, OffsetTracker(), WorkerMetrics(), "w1", lambda t: True, spool, flush_s=0.01)  # type: ignore[arg-type]
    try:
        spool.put([_usage(i) for i in range(3)])
        remove = Spool.remove

        def full(self, ids):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(Spool, "remove", full)
        await d.flush_once()
        assert d.ledger_down is None and len(spool) == 3 and len(ledger.rows) == 3
        assert "cannot be read or emptied" in caplog.text
        monkeypatch.setattr(Spool, "remove", remove)
        await d.flush_once()
        assert len(spool) == 0 and len(ledger.rows) == 3 and d.flush_failing is None
    finally:
        spool.close()
