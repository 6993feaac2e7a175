"""Reports read one snapshot: rows written while a report is being made change none of its figures.

A report is several statements. Read each in a snapshot of its own (PostgreSQL's READ COMMITTED; SQLite, whose driver
opens a transaction only before a write), it set the sums it checks against the invoices read a moment later, and said
that invoices did not match their rows while a worker was writing. Runs on SQLite and the machine's PostgreSQL; the
write is made from a second engine (another connection) in the middle of the report.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from typing import Any

import pytest
from sqlalchemy import Engine

from billing import conservation, db, reconcile, sre
from billing.config import LedgerConfig
from billing.ledger import Ledger
from billing.records import BusyRecord
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("2.50"))
OCT = datetime(2026, 10, 5, 12, tzinfo=timezone.utc)
NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


def _write_batch(ledger: Ledger, n: int) -> None:
    """One engine batch of October: its requests' rows, then its busy record (base + LoRA, to the microsecond)."""
    rows = [usage_record(f"b{n}-{i}", created_at=OCT + timedelta(seconds=n), base_us=1_000 + i, lora_us=300, routing_us=7,
                         input_tokens=5, output_tokens=3, worker_id="w0") for i in range(3)]
    ledger.record_usage(rows)
    at = OCT + timedelta(seconds=n)
    ledger.record_busy([BusyRecord("w0", "h100", at, at + timedelta(milliseconds=10), sum(r.base_us + r.lora_us for r in rows), 1)])


@pytest.fixture
def ledgers(engine: Engine) -> Any:
    """The ledger the report reads (`engine`), and a writer on a connection of its own, each with one batch written."""
    writer_engine = db.make_engine(engine.url)
    writer = Ledger(writer_engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    _write_batch(writer, 0)
    yield writer
    writer_engine.dispose()


def _midway(monkeypatch: pytest.MonkeyPatch, module: object, name: str, write: Callable[[], None]) -> None:
    """Make `write` happen when the report calls module.name, between its first reads and its last."""
    original = getattr(module, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        write()
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)


def test_reconcile_is_one_snapshot(engine: Engine, ledgers: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch written while reconcile runs leaves it conserved: its sums and its invoices are of the same rows."""
    _midway(monkeypatch, reconcile, "period_conservation", lambda: _write_batch(ledgers, 1))
    report = reconcile.reconcile_report(engine, "2026-10", CONFIG, now=NOW)
    assert (report.us("invoice_difference"), report.us("unexplained_busy")) == (0, 0)
    assert report.us("base") == 1_000 + 1_001 + 1_002 and report.conserved
    monkeypatch.undo()
    after = reconcile.reconcile_report(engine, "2026-10", CONFIG, now=NOW)
    assert after.us("base") == 2 * (1_000 + 1_001 + 1_002) and after.conserved


def test_sre_and_conservation_are_one_snapshot(engine: Engine, ledgers: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch written while the SRE report (or the conservation check) runs leaves busy and attributed time equal."""
    _midway(monkeypatch, sre, "worker_times", lambda: _write_batch(ledgers, 1))
    report = sre.sre_report(engine, "2026-10", now=NOW)
    assert report.unattributed_s == 0 and report.busy_s == report.attributed_s == Decimal("0.003903")
    _midway(monkeypatch, conservation, "period_invoices", lambda: _write_batch(ledgers, 2))
    cons = conservation.period_conservation(engine, "2026-10", CONFIG)
    assert cons.unattributed_us == 0 and cons.busy_us == 2 * 3_903
