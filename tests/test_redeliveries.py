"""Redelivered work: a request that ran again after its row was written bills nothing more, and its busy time is named.

Runs on SQLite and the machine's PostgreSQL (the COPY write path).
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from decimal import Decimal

from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing.config import LedgerConfig
from billing.invoice import build_invoice
from billing.invoice_render import render_json
from billing.ledger import Ledger
from billing.models import Usage, UsageRedelivery
from billing.reconcile import reconcile_report
from billing.records import BusyRecord
from billing.sre import sre_report
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"))
OCT = datetime(2026, 10, 5, 12, tzinfo=timezone.utc)
NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)


def _ledger(engine: Engine) -> Ledger:
    return Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))


def _kept(engine: Engine) -> list[tuple[str, str, int]]:
    with Session(engine) as session:
        return sorted(session.execute(select(UsageRedelivery.request_id, UsageRedelivery.worker_id, UsageRedelivery.base_us + UsageRedelivery.lora_us)))


def test_a_retried_write_is_no_redelivery(engine: Engine) -> None:
    """The same copy written again (a retried flush, the spool) adds no row and keeps no redelivery."""
    ledger = _ledger(engine)
    first = [usage_record(f"r{i}", created_at=OCT, worker_id="w0", base_us=100 + i) for i in range(3)]
    assert ledger.record_usage(first) == 3
    assert ledger.record_usage(first + first[:1]) == 0
    assert _kept(engine) == []


def test_a_rerun_is_kept_once_and_bills_nothing(engine: Engine) -> None:
    """A second run of r1 (another worker, later receipt) leaves the first row and the draft as they were; it is kept once, however often it is written."""
    ledger = _ledger(engine)
    first = usage_record("r1", created_at=OCT, worker_id="w0", base_us=1_000, lora_us=200)
    ledger.record_usage([first, usage_record("r2", created_at=OCT, worker_id="w0", base_us=300)])
    ledger.record_busy([BusyRecord("w0", "h100", OCT, OCT + timedelta(seconds=1), 1_500, 2)])
    draft = render_json(build_invoice(engine, "acme", "2026-10", CONFIG))
    rerun = replace(first, worker_id="w1", created_at=OCT + timedelta(minutes=5), base_us=1_100, lora_us=250)
    again = replace(rerun, worker_id="w2", created_at=OCT + timedelta(minutes=6), base_us=1_050, lora_us=240)
    assert ledger.record_usage([rerun, rerun]) == 0
    assert ledger.record_usage([rerun, again, first]) == 0
    ledger.record_busy([BusyRecord("w1", "h100", rerun.created_at, rerun.created_at + timedelta(seconds=1), 1_350, 1),
                        BusyRecord("w2", "h100", again.created_at, again.created_at + timedelta(seconds=1), 1_290, 1)])
    assert _kept(engine) == [("r1", "w1", 1_350), ("r1", "w2", 1_290)]
    assert ledger.usage_for("acme", "r1").base_us == 1_000  # type: ignore[union-attr]  # the first row bills
    assert render_json(build_invoice(engine, "acme", "2026-10", CONFIG)) == draft
    report = reconcile_report(engine, "2026-10", CONFIG, now=NOW)
    assert (report.us("gpu_busy"), report.us("base") + report.us("lora"), report.us("redelivered_work")) == (4_140, 1_500, 2_640)
    assert report.us("unexplained_busy") == 0 and report.conserved
    with Session(engine) as session:
        assert session.scalar(select(Usage.worker_id).where(Usage.request_id == "r1")) == "w0"


def test_the_sre_report_names_redelivered_work_as_attributed(engine: Engine) -> None:
    """The SRE report's unattributed_s agrees with reconcile: a rerun's busy time is redelivered work, named there, not
    unattributed (it showed the rerun's 1.35 ms as unattributed while reconcile said every microsecond was explained)."""
    ledger = _ledger(engine)
    first = usage_record("r1", created_at=OCT, worker_id="w0", base_us=1_000, lora_us=200)
    ledger.record_usage([first])
    rerun = replace(first, worker_id="w1", created_at=OCT + timedelta(minutes=5), base_us=1_100, lora_us=250)
    ledger.record_usage([rerun])
    ledger.record_busy([BusyRecord("w0", "h100", OCT, OCT + timedelta(seconds=1), 1_200, 1),
                        BusyRecord("w1", "h100", rerun.created_at, rerun.created_at + timedelta(seconds=1), 1_350, 1)])
    assert reconcile_report(engine, "2026-10", CONFIG, now=NOW).conserved
    report = sre_report(engine, "2026-10", now=NOW)
    assert (report.busy_s, report.attributed_s, report.unattributed_s) == (Decimal("0.002550"), Decimal("0.001200"), Decimal("0.000000"))
