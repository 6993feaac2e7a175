"""The finance, SRE and reconciliation reports: figures by hand, the four formats read back alike, and the HTML page in headless Chromium.

Runs on SQLite and the machine's PostgreSQL (the Chromium checks on SQLite only: the page is the same).
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from billing.closing import close_invoice, close_period
from billing.config import LedgerConfig
from billing.errors import MixedCurrencyError, PriceCurrencyError
from billing.finance import finance_report
from billing.ledger import Ledger
from billing.prices import set_token_price
from billing.records import AdapterLoadRecord, BusyRecord
from billing.reconcile import reconcile_report
from billing.report_render import FORMATS, render_report
from billing.sre import nearest_rank, sre_report
from tests.browser import CHROMIUM, page_problems
from tests.report_formats import READERS
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("3.60"))  # 1e-9 per us
SX = "11" * 32


def oct_(day: int, us: int = 0) -> datetime:
    return datetime(2026, 10, day, 12, tzinfo=timezone.utc) + timedelta(microseconds=us)


@pytest.fixture
def october(engine: Engine) -> Engine:
    """acme (premium) pays well for little GPU; globex (standard) uses most of the GPU for little revenue.

    GPU time (base + lora + routing - kv): acme 1_000_000 us, globex 3_000_000 us, plus x@1's 200_000 us
    load, all of globex's: 4_200_000 us. Revenue: acme 1M input tokens at 2.00/M = 2.00; globex 1M at 0.50/M = 0.50.
    GPU share: acme 1.0/4.2 = 0.2381, globex 3.2/4.2 = 0.7619; revenue share 0.8 / 0.2: globex is flagged (0.76 > 1.5 x 0.2).
    """
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, display_name, tier) VALUES ('acme', 'Acme', 'premium'), ('globex', 'Globex', 'standard')"))
    set_token_price(engine, "premium", Decimal("2.00"), Decimal("0"), date(2026, 1, 1), currency="USD")
    set_token_price(engine, "standard", Decimal("0.50"), Decimal("0"), date(2026, 1, 1), currency="USD")
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    ledger.record_usage([
        usage_record("a1", created_at=oct_(3), input_tokens=10**6, base_us=1_000_000, total_us=1_500_000, ttft_us=100_000),
        *[usage_record(f"g{i}", tenant_id="globex", created_at=oct_(4), adapter="x@1", adapter_sha256=SX, input_tokens=10**4,
                       cached_tokens=1_000,
                       base_us=20_000, lora_us=9_000, routing_us=1_500, kv_saved_us=500, total_us=(i + 1) * 1_000, ttft_us=(i + 1) * 100)
          for i in range(100)],
    ])
    ledger.record_adapter_loads([AdapterLoadRecord("x@1", SX, "platform", "disk", 1 << 20, 200_000, "w0", oct_(2))])
    ledger.record_busy([
        BusyRecord("w0", "h100", oct_(3), oct_(3, 2_000_000), 1_000_000, 10),  # 1 s busy in a 2 s span
        BusyRecord("w1", "h100", oct_(4), oct_(4, 3_000_000), 2_900_000, 100),  # 2.9 s busy in 3 s
    ])
    return engine


def test_finance_report_by_hand(october: Engine) -> None:
    """Per tenant: revenue, GPU cost, margin and the two shares; the tenant whose GPU share passes 1.5x its revenue share is flagged."""
    report = finance_report(october, "2026-10", CONFIG)
    acme, globex = report.tenants
    assert (acme.tenant, acme.tier, acme.gpu_ms, acme.cost, acme.revenue, acme.margin) == (
        "acme", "premium", Decimal("1000.000"), Decimal("0.001000000"), Decimal("2.000000000"), Decimal("1.999000000"))
    assert (globex.gpu_ms, globex.cost, globex.revenue) == (Decimal("3200.000"), Decimal("0.003200000"), Decimal("0.500000000"))
    assert (acme.gpu_share, acme.revenue_share, acme.flagged) == (Decimal("0.2381"), Decimal("0.8000"), False)
    assert (globex.gpu_share, globex.revenue_share, globex.flagged) == (Decimal("0.7619"), Decimal("0.2000"), True)
    assert (report.revenue, report.cost, report.margin) == (Decimal("2.500000000"), Decimal("0.004200000"), Decimal("2.495800000"))
    assert not finance_report(october, "2026-10", CONFIG, flag_factor=Decimal("4")).tenants[1].flagged  # 0.76 < 4 x 0.2
    for t in report.tenants:
        assert all(type(v) is Decimal for v in (t.cost, t.revenue, t.margin, t.gpu_share, t.revenue_share))


def test_finance_report_is_in_its_invoices_currency(october: Engine) -> None:
    """The report names the currency its invoices are in, never ledger.currency's relabel of them; two currencies are refused.

    Closed in USD, the month's report under a config saying EUR said "EUR" over the USD amounts; acme closed in USD
    beside globex's EUR draft were added up into one total. globex's draft under EUR is refused first now: its tokens
    would be priced with the USD entries (billing/prices.py); with EUR entries, the two currencies are (MixedCurrencyError).
    No price may reach a month closed for some tenants (billing/prices.py), so November's EUR entry is set before its close.
    """
    nov, dec = (datetime(2026, month, 2, tzinfo=timezone.utc) for month in (11, 12))
    eur = CONFIG.model_copy(update={"currency": "EUR"})
    close_invoice(october, CONFIG, "acme", "2026-10", now=nov)
    with pytest.raises(PriceCurrencyError, match=r"set in USD, and this invoice is in ledger.currency EUR"):
        finance_report(october, "2026-10", eur)
    close_period(october, CONFIG, "2026-10", now=nov)
    report = finance_report(october, "2026-10", eur)
    assert report.currency == "USD" and report.cost == finance_report(october, "2026-10", CONFIG).cost
    set_token_price(october, "standard", Decimal("1"), Decimal("0"), date(2026, 11, 1), currency="EUR")
    Ledger(october, CONFIG.model_copy(update={"url": str(october.url)})).record_usage([
        usage_record("n1", tenant_id="globex", created_at=nov + timedelta(days=1), input_tokens=10)])
    close_invoice(october, CONFIG, "acme", "2026-11", now=dec)  # no usage: an empty invoice, closed in USD
    with pytest.raises(MixedCurrencyError, match=r"2 currencies \(EUR: globex \(draft\); USD: acme \(closed\)\).*ledger.currency"):
        finance_report(october, "2026-11", eur)


def test_sre_report_by_hand(october: Engine) -> None:
    """Per adapter: GPU seconds by component, routing overhead, cold starts, nearest-rank latency; per worker: busy, span and idle."""
    report = sre_report(october, "2026-10")
    base, x = report.adapters
    assert (base.adapter, base.requests, base.base_s, base.total_ms) == ("base", 1, Decimal("1.000000"), (Decimal("1500.000"),) * 3)
    assert (x.requests, x.base_s, x.lora_s, x.routing_s, x.kv_saved_s, x.cold_start_s, x.cold_starts) == (
        100, Decimal("2.000000"), Decimal("0.900000"), Decimal("0.150000"), Decimal("0.050000"), Decimal("0.200000"), 1)
    assert (x.gpu_s, x.kv_measured_s, x.cached_tokens) == (Decimal("3.200000"), Decimal("0.050000"), 100_000)
    assert x.routing_overhead == Decimal("0.3443")  # (1_500 + 9_000) / (20_000 + 9_000 + 1_500)
    assert x.total_ms == (Decimal("50.000"), Decimal("95.000"), Decimal("99.000"))  # 1..100 ms: nearest rank
    assert x.ttft_ms == (Decimal("5.000"), Decimal("9.500"), Decimal("9.900"))
    w0, w1 = report.workers
    assert (w0.busy_s, w0.span_s, w0.idle_s, w0.busy_share) == (Decimal("1.000000"), Decimal("2.000000"), Decimal("1.000000"), Decimal("0.5000"))
    assert (w1.idle_s, report.idle_s) == (Decimal("0.100000"), Decimal("1.100000"))
    # Busy 3.9 s against attributed base + LoRA of 1 + 2.9 s: nothing unattributed.
    assert (report.busy_s, report.attributed_s, report.unattributed_s) == (Decimal("3.900000"), Decimal("3.900000"), Decimal("0.000000"))


@pytest.mark.parametrize(("values", "p", "expected"), [([], 50, 0), ([7], 99, 7), ([1, 2, 3, 4], 50, 2), ([1, 2, 3, 4], 51, 3), (list(range(1, 101)), 95, 95)])
def test_nearest_rank(values: list[int], p: int, expected: int) -> None:
    """The p-th percentile is the smallest value with at least p% of the values at or below it; none gives 0."""
    assert nearest_rank(values, p) == expected


@pytest.mark.parametrize("kind", ["finance", "sre", "reconcile"])
def test_every_format_carries_the_same_figures(october: Engine, kind: str) -> None:
    """One report rendered as table, JSON, CSV and HTML reads back to the same summary and rows in all four (the CSV's summary row included)."""
    report = {"finance": lambda: finance_report(october, "2026-10", CONFIG), "sre": lambda: sre_report(october, "2026-10"),
              "reconcile": lambda: reconcile_report(october, "2026-10", CONFIG)}[kind]()
    forms = {fmt: READERS[fmt](render_report(report, fmt)) for fmt in FORMATS}
    assert forms["json"]["summary"][0] and all(forms["json"].values())  # a summary, and rows in every table
    for fmt in ("table", "csv", "html"):
        assert forms[fmt] == forms["json"], fmt


def test_report_figures_by_format(october: Engine) -> None:
    """The figures a reader looks for, in JSON (decimals as fixed-point strings) and CSV (summary first)."""
    finance = finance_report(october, "2026-10", CONFIG)
    document = json.loads(render_report(finance, "json"))
    assert document["report"] == "finance" and document["summary"]["revenue"] == "2.500000000" and document["summary"]["flagged"] == 1
    assert [(t["tenant"], t["margin"], t["flagged"]) for t in document["tenants"]] == [("acme", "1.999000000", False), ("globex", "0.496800000", True)]
    rows = list(csv.DictReader(io.StringIO(render_report(finance, "csv"))))
    assert [(r["section"], r["tenant"], r["margin"], r["flagged"]) for r in rows] == [
        ("summary", "", "2.495800000", "1"), ("tenants", "acme", "1.999000000", ""), ("tenants", "globex", "0.496800000", "yes")]
    sre = sre_report(october, "2026-10")
    rows = list(csv.DictReader(io.StringIO(render_report(sre, "csv"))))
    assert [(r["section"], r["adapter"] or r["worker"]) for r in rows] == [("summary", ""), ("adapters", "base"), ("adapters", "x@1"), ("workers", "w0"), ("workers", "w1")]
    assert rows[0]["unattributed_s"] == "0.000000" and rows[0]["busy_s"] == "3.900000"
    table = render_report(sre, "table")
    assert table.startswith("SRE report 2026-10\n") and "unattributed_s=0.000000" in table and "x@1" in table


def test_reconcile_by_hand(october: Engine) -> None:
    """October: busy 3.9 s = base 3.0 + LoRA 0.9 s exactly; the invoices' 4.2 s = that + 0.15 s decisions - 0.05 s credit + 0.2 s load."""
    report = reconcile_report(october, "2026-10", CONFIG)
    figures = {line.item: line.us for line in report.lines}
    assert figures == {
        "gpu_busy": 3_900_000, "carried_in": 0, "gpu_idle": 1_100_000, "adapter_loads": 200_000,
        "base": 3_000_000, "lora": 900_000, "routing_decisions": 150_000, "kv_credit": -50_000, "cold_start_spread": 200_000,
        "late_usage": 0, "invoiced": 4_200_000,
        "billed_later": 0, "redelivered_work": 0, "unused_loads": 0, "unbilled_work": 0, "carried_out": 0, "unexplained_busy": 0, "invoice_difference": 0,
    }
    assert report.conserved and report.residue_us == 0 and (report.invoices, report.closed_invoices) == (2, 0)


needs_chromium = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="Debian's chromium is not installed (.ci/run installs it)")


@needs_chromium
@pytest.mark.parametrize("kind", ["finance", "sre"])
def test_html_report_renders_in_chromium(october: Engine, tmp_path: Path, kind: str, db_url: str) -> None:
    """The HTML report is one self-contained file whose charts load in headless Chromium with no console error."""
    if not db_url.startswith("sqlite"):
        pytest.skip("the page is the same on both backends; Chromium runs once")
    report = finance_report(october, "2026-10", CONFIG) if kind == "finance" else sre_report(october, "2026-10")
    page = tmp_path / f"{kind}.html"
    page.write_text(render_report(report, "html"), encoding="utf-8")
    html = page.read_text()
    assert html.count('<img alt="') >= 2 and "http://" not in html and "https://" not in html and "<script" not in html
    assert page_problems(page) == []


@needs_chromium
def test_chromium_check_catches_broken_pages(tmp_path: Path) -> None:
    """The browser check fails a page with a script error, a console error, a broken image or no image at all."""
    png = render_report_png()
    good = f'<!DOCTYPE html><html><body><img alt="chart" src="data:image/png;base64,{png}"></body></html>'
    broken = {
        "exception": good.replace("</body>", "<script>notAFunction();</script></body>"),
        "console": good.replace("</body>", "<script>console.error('boom');</script></body>"),
        "image": good.replace(png, "AAAA" + png[4:]),  # no PNG signature: the image cannot decode
        "missing": good.replace('<img alt="chart"', '<img alt="gone" src="missing.png"><img alt="chart"'),
        "no image": "<!DOCTYPE html><html><body>nothing</body></html>",
    }
    page = tmp_path / "good.html"
    page.write_text(good)
    assert page_problems(page) == []
    for name, body in broken.items():
        page = tmp_path / f"{name.replace(' ', '_')}.html"
        page.write_text(body)
        assert page_problems(page), f"the check passed a page with a {name} problem"


def render_report_png() -> str:
    import base64

    from billing.charts import _empty

    return base64.b64encode(_empty("a chart")).decode("ascii")
