"""Names an operator or a worker chose (a tier, a GPU kind) carried into every report and invoice format: a CSV opened in
a spreadsheet must not run one as a formula, an aligned table must keep each row on one line, the HTML page escapes it."""

from __future__ import annotations

import csv
import io
import json
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, text

from billing.config import LedgerConfig
from billing.finance import finance_report
from billing.invoice import build_invoice
from billing.invoice_render import csv_text, plain_text, render_csv, render_json, render_table
from billing.ledger import Ledger
from billing.records import BusyRecord
from billing.report_render import render_report
from billing.sre import sre_report
from tests.test_ledger import usage_record

TIER = "=HYPERLINK(\"http://x\")|\n<b>"  # 1-32 characters without surrounding spaces: `tenants add --tier` takes it
GPU = "@SUM(1+1)*cmd|' /C calc'!A0"
CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("3.60"), gpu_kind=GPU)  # the fallback prices it
AT = datetime(2026, 10, 3, 12, tzinfo=timezone.utc)


@pytest.fixture
def hostile(engine: Engine) -> Engine:
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, display_name, tier) VALUES ('acme', 'Acme', :tier)"), {"tier": TIER})
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    ledger.record_usage([usage_record("r1", created_at=AT, input_tokens=5, base_us=1_000, tier=TIER, gpu_kind=GPU)])
    ledger.record_busy([BusyRecord("w0", GPU, AT, AT.replace(second=2), 1_000, 1)])
    return engine


@pytest.mark.parametrize("value, written", [
    ("=1+1", "'=1+1"), ("+1", "'+1"), ("-1+1", "'-1+1"), ("@SUM(A1)", "'@SUM(A1)"), ("\t=1", "'\t=1"), ("\r=1", "'\r=1"),
    ("acme", "acme"), ("a=1", "a=1"), ("", ""), ('["premium"]', '["premium"]'),
])
def test_csv_text(value: str, written: str) -> None:
    assert csv_text(value) == written


def test_plain_text() -> None:
    assert plain_text("a\nb\tc\x00d|<e>") == "a\\nb\\tc\\x00d|<e>"
    assert plain_text("é ok") == "é ok"


def _csv_cells(rendered: str) -> list[str]:
    return [cell for row in csv.reader(io.StringIO(rendered)) for cell in row]


def test_report_csv_runs_no_formula(hostile: Engine) -> None:
    """The finance report's tier and the SRE report's GPU kind start with "=" and "@": each CSV cell holding them starts
    with "'" (before, a spreadsheet ran them); its numbers, a negative margin among them, are written as they are."""
    finance = finance_report(hostile, "2026-10", CONFIG)
    assert finance.margin < 0
    for report in (finance, sre_report(hostile, "2026-10")):
        cells = _csv_cells(render_report(report, "csv"))
        assert not [c for c in cells if c[:1] in ("=", "+", "@", "\t", "\r")], cells
        assert not [c for c in cells if c.startswith("-") and not c.lstrip("-").replace(".", "").isdigit()], cells
    rows = list(csv.DictReader(io.StringIO(render_report(finance, "csv"))))
    assert rows[1]["tier"] == "'" + TIER and rows[0]["margin"] == rows[1]["margin"] and rows[0]["margin"].startswith("-0.")
    workers = [r for r in csv.DictReader(io.StringIO(render_report(sre_report(hostile, "2026-10"), "csv"))) if r["section"] == "workers"]
    assert workers[0]["gpu_kinds"] == "'" + GPU


def test_report_table_keeps_a_row_on_one_line(hostile: Engine) -> None:
    """A newline in a tier's name is written as "\\n": the finance table's row for the tenant stays one line."""
    table = render_report(finance_report(hostile, "2026-10", CONFIG), "table")
    row = next(line for line in table.splitlines() if line.startswith("acme "))
    assert plain_text(TIER) in row and row.endswith("yes                      1")
    assert len(table.splitlines()) == 7


def test_report_html_and_json_carry_the_name_escaped(hostile: Engine) -> None:
    report = finance_report(hostile, "2026-10", CONFIG)
    page = render_report(report, "html")
    assert "<b>" not in page and "&lt;b&gt;" in page
    assert json.loads(render_report(report, "json"))["tenants"][0]["tier"] == TIER


def test_invoice_csv_runs_no_formula_and_table_stays_aligned(hostile: Engine) -> None:
    """The invoice carries the tier in tiers_billed (a JSON array: it starts with "[") and the GPU kind nowhere;
    a formula-like adapter line label or tenant is written behind "'" all the same (render_csv's head and adapter)."""
    invoice = build_invoice(hostile, "acme", "2026-10", CONFIG)
    rows = list(csv.DictReader(io.StringIO(render_csv(invoice))))
    assert json.loads(rows[-1]["tiers_billed"]) == [TIER] and json.loads(render_json(invoice))["tiers_billed"] == [TIER]
    forged = invoice.__class__(**{**invoice.__dict__, "tenant": "=cmd"})
    assert {row["tenant"] for row in csv.DictReader(io.StringIO(render_csv(forged)))} == {"'=cmd"}
    lines = render_table(invoice).splitlines()
    assert len({len(lines[1]), *(len(line) for line in lines[3:-1] if not set(line) <= {"-", " "})}) == 1, lines
