"""Revision 0006 splits the LoRA compute out of closed invoices' routing_us, on SQLite and the machine's PostgreSQL.

The invoices are closed by the code at head (lora_us and routing_us apart), merged back by the downgrade to
0005 as a 0005 ledger held them, then split again by the upgrade: each closed invoice must read back as it
was closed, GPU time and money unchanged.
"""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, inspect, text
from sqlalchemy.orm import Session

from billing import db
from billing.closing import close_period
from billing.config import LedgerConfig
from billing.invoice import Invoice, read_closed
from billing.invoice_render import render_csv, render_json, render_table
from billing.ledger import Ledger
from billing.prices import set_gpu_price
from migrations import SCRIPT_LOCATION
from tests.test_ledger import load_record, usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"), gpu_kind="h100")
S1, S2 = "11" * 32, "22" * 32
NOV_2 = datetime(2026, 11, 2, tzinfo=timezone.utc)


def oct_(day: int) -> datetime:
    return datetime(2026, 10, day, 12, tzinfo=timezone.utc)


def _closed(engine: Engine) -> dict[str, Invoice]:
    with Session(engine) as session:
        return read_closed(session, "2026-10")


def _frozen_columns(engine: Engine) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(
            "SELECT l.adapter, l.gpu_price_per_hour, l.base_us, l.routing_us FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id "
            "ORDER BY i.tenant_id, l.position"
        ))]


@pytest.fixture
def closed_october(migrated_url: str) -> tuple[str, dict[str, Invoice]]:
    """October 2026 closed at head. GPU price: 7.20 (fallback) until the 10th, 10.80 (h100 from Oct 10) after, 3.60 from
    the 20th. acme: x@1 in all three segments (three lines), the base model once, y@1 before the 10th with its load
    after the 20th (a line of cold start alone at 3.60); globex: x@1 once at 10.80, and its share of x@1's load of the
    2nd (a line of cold start alone at 7.20)."""
    engine = db.make_engine(migrated_url)
    try:
        set_gpu_price(engine, "h100", Decimal("10.80"), date(2026, 10, 10), currency="USD")
        set_gpu_price(engine, "h100", Decimal("3.60"), date(2026, 10, 20), currency="USD")
        set_gpu_price(engine, "a10", Decimal("1.00"), date(2026, 10, 5), currency="USD")  # another kind: its list reproduces nothing
        ledger = Ledger(engine, CONFIG.model_copy(update={"url": migrated_url}))
        ledger.record_usage([
            usage_record("a1", created_at=oct_(3), adapter="x@1", adapter_sha256=S1, output_tokens=10, base_us=10_000, lora_us=2_000, routing_us=300),
            usage_record("a2", created_at=oct_(4), adapter="x@1", adapter_sha256=S1, output_tokens=5, base_us=8_000, lora_us=1_500, routing_us=200),
            usage_record("a3", created_at=oct_(12), adapter="x@1", adapter_sha256=S1, output_tokens=7, base_us=9_000, lora_us=4_000, routing_us=100),
            usage_record("a4", created_at=oct_(25), adapter="x@1", adapter_sha256=S1, status="failed", error_code="oom",
                         base_us=1_000, lora_us=700, routing_us=50),
            usage_record("a5", created_at=oct_(6), output_tokens=3, base_us=5_000, routing_us=400),
            usage_record("a6", created_at=oct_(7), adapter="y@1", adapter_sha256=S2, output_tokens=4, base_us=3_000, lora_us=600, routing_us=10),
            usage_record("g1", tenant_id="globex", created_at=oct_(13), adapter="x@1", adapter_sha256=S1, output_tokens=9,
                         base_us=20_000, lora_us=5_000, routing_us=900),
        ])
        ledger.record_adapter_loads([
            load_record(adapter="x@1", adapter_sha256=S1, tenant_id="acme", load_us=30_000, created_at=oct_(2)),
            load_record(adapter="y@1", adapter_sha256=S2, tenant_id="acme", load_us=12_000, created_at=oct_(22)),
        ])
        close_period(engine, CONFIG, "2026-10", now=NOV_2)
        return migrated_url, _closed(engine)
    finally:
        engine.dispose()


def test_closed_invoices_split_again_as_they_were_closed(closed_october: tuple[str, dict[str, Invoice]]) -> None:
    """Downgrading merges lora_us into routing_us (0005's column); upgrading splits every line back exactly, including
    lines a GPU price change made; GPU time, cost and every rendering are unchanged."""
    url, closed = closed_october
    acme = closed["acme"]
    assert [(line.adapter, line.gpu_price_per_hour, line.lora_ms, line.routing_ms) for line in acme.lines] == [
        ("base", Decimal("7.200000000"), Decimal("0.000"), Decimal("0.400")),
        ("x@1", Decimal("3.600000000"), Decimal("0.700"), Decimal("0.050")),
        ("x@1", Decimal("7.200000000"), Decimal("3.500"), Decimal("0.500")),
        ("x@1", Decimal("10.800000000"), Decimal("4.000"), Decimal("0.100")),
        ("y@1", Decimal("3.600000000"), Decimal("0.000"), Decimal("0.000")),  # its load alone
        ("y@1", Decimal("7.200000000"), Decimal("0.600"), Decimal("0.010")),
    ]
    db.downgrade(url, "0005", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    try:
        assert "lora_us" not in {c["name"] for c in inspect(engine).get_columns("invoice_lines")}
        merged = _frozen_columns(engine)
        assert [routing for *_, routing in merged] == [400, 750, 4_000, 4_100, 0, 610, 0, 5_900]
        db.upgrade(url, script_location=SCRIPT_LOCATION, currency="USD")  # its prices were set in USD
        engine.dispose()
        again = _closed(engine)
        assert again == closed
        for tenant in closed:
            for render in (render_json, render_csv, render_table):
                assert render(again[tenant]) == render(closed[tenant])
    finally:
        engine.dispose()


def test_lines_that_no_longer_match_keep_their_merged_time(closed_october: tuple[str, dict[str, Invoice]]) -> None:
    """A frozen line whose usage rows no longer reproduce it (a row edited by hand) is not guessed at: it keeps the
    LoRA time inside routing_ms and lora_ms 0; its GPU time and cost stay; the other lines are split."""
    url, closed = closed_october
    db.downgrade(url, "0005", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text("UPDATE usage SET lora_us = lora_us + 1 WHERE request_id IN ('a3', 'g1')"))
        db.upgrade(url, script_location=SCRIPT_LOCATION, currency="USD")  # its prices were set in USD
        engine.dispose()
        again = _closed(engine)
    finally:
        engine.dispose()
    assert [(line.lora_ms, line.routing_ms) for line in again["globex"].lines] == [
        (Decimal("0.000"), Decimal("0.000")), (Decimal("0.000"), Decimal("5.900")),
    ]
    assert [(line.lora_ms, line.routing_ms) for line in again["acme"].lines if line.adapter == "x@1"] == [
        (Decimal("0.000"), Decimal("0.750")), (Decimal("0.000"), Decimal("4.000")), (Decimal("0.000"), Decimal("4.100")),
    ]  # the three lines of one price change are split together or not at all
    assert [(line.adapter, line.lora_ms, line.routing_ms) for line in again["acme"].lines if line.adapter != "x@1"] == [
        ("base", Decimal("0.000"), Decimal("0.400")), ("y@1", Decimal("0.000"), Decimal("0.000")), ("y@1", Decimal("0.600"), Decimal("0.010")),
    ]
    for tenant, invoice in closed.items():
        assert again[tenant].totals.gpu_ms == invoice.totals.gpu_ms and again[tenant].totals.cost == invoice.totals.cost
        assert [line.gpu_ms for line in again[tenant].lines] == [line.gpu_ms for line in invoice.lines]
        assert again[tenant].totals.lora_ms == sum((line.lora_ms for line in again[tenant].lines), Decimal("0.000"))


def test_offline_script_splits_single_lines() -> None:
    """`alembic upgrade 0005:0006 --sql` adds lora_us and splits the lines alone in their (adapter, month) in plain SQL."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", "alembic", "-x", "url=postgresql+psycopg://nobody@127.0.0.1:1/none", "upgrade",
                           "0005:0006", "--sql"], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ALTER TABLE invoice_lines ADD COLUMN lora_us BIGINT" in done.stdout
    assert "UPDATE invoice_lines SET lora_us = (SELECT COALESCE(SUM(u.lora_us), 0)" in done.stdout
    assert "UPDATE invoice_lines SET routing_us = routing_us - lora_us" in done.stdout
    assert "split only by an online upgrade" in done.stderr
