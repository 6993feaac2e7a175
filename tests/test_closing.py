"""Invoice lifecycle: drafts, closing, frozen invoices, late usage as adjustments in the next open period.

Runs on SQLite and the machine's PostgreSQL. PRICE makes one microsecond cost exactly 2e-9.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import date, datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.closing import close_invoice, close_period
from billing.config import LedgerConfig
from billing.errors import MixedCurrencyError, PeriodNotEndedError, UnbillablePeriodError, UnknownTenantError
from billing.finance import finance_report
from billing.invoice import build_invoice, period_invoices
from billing.invoice_render import render_csv, render_json, render_table
from billing.ledger import Ledger
from billing.models import ClosedInvoice, ColdStartShare, Tenant, Usage
from billing.prices import set_gpu_price, set_token_price
from tests.test_ledger import load_record, usage_record

PRICE = Decimal("7.20")
CONFIG = LedgerConfig(gpu_price_per_hour=PRICE)
S1 = "11" * 32
NOV_2 = datetime(2026, 11, 2, tzinfo=timezone.utc)
DEC_2 = datetime(2026, 12, 2, tzinfo=timezone.utc)


def oct_(day: int, hour: int = 12) -> datetime:
    return datetime(2026, 10, day, hour, tzinfo=timezone.utc)


def nov(day: int) -> datetime:
    return datetime(2026, 11, day, 12, tzinfo=timezone.utc)


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url), gpu_price_per_hour=PRICE))


@pytest.fixture
def october(ledger: Ledger) -> Ledger:
    """October 2026: acme used x@1 (300 tokens) and the base model; globex used x@1 (100 tokens); one 40_000 us load of x@1."""
    ledger.record_usage([
        usage_record("a1", created_at=oct_(3), adapter="x@1", adapter_sha256=S1, input_tokens=200, output_tokens=100, base_us=10_000, lora_us=2_000),
        usage_record("a2", created_at=oct_(4), input_tokens=10, output_tokens=10, base_us=5_000),
        usage_record("g1", tenant_id="globex", created_at=oct_(5), adapter="x@1", adapter_sha256=S1, input_tokens=50, output_tokens=50, base_us=7_000),
    ])
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=40_000, created_at=oct_(2))])
    return ledger


def renders(engine: Engine, tenant: str, period: str) -> tuple[str, str, str]:
    invoice = build_invoice(engine, tenant, period, CONFIG)
    return render_json(invoice), render_table(invoice), render_csv(invoice)


def test_period_closes_only_after_it_ended(october: Ledger, engine: Engine) -> None:
    """A month cannot be closed before its last UTC instant has passed: its usage is still arriving."""
    for close in (lambda now: close_period(engine, CONFIG, "2026-10", now=now), lambda now: close_invoice(engine, CONFIG, "acme", "2026-10", now=now)):
        with pytest.raises(PeriodNotEndedError, match=r"runs until 2026-11-01T00:00Z.*close it after it has ended"):
            close(datetime(2026, 10, 31, 23, 59, 59, 999999, tzinfo=timezone.utc))
    assert build_invoice(engine, "acme", "2026-10", CONFIG).status == "draft"
    assert close_invoice(engine, CONFIG, "acme", "2026-10", now=datetime(2026, 11, 1, tzinfo=timezone.utc)).status == "closed"


def test_closed_invoice_never_changes_and_late_usage_is_an_adjustment(october: Ledger, engine: Engine) -> None:
    """Append-only: a closed invoice renders byte-identically after late usage and loads; the late usage is billed on the next open period as an adjustment line."""
    closed = close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    assert closed.status == "closed" and closed.closed_at == NOV_2
    before = renders(engine, "acme", "2026-10")
    october.record_usage([
        usage_record("a3", created_at=oct_(30), adapter="x@1", adapter_sha256=S1, input_tokens=1_000, output_tokens=0, base_us=50_000, lora_us=5_000),
        usage_record("a4", created_at=nov(5), adapter="x@1", adapter_sha256=S1, input_tokens=10, output_tokens=10, base_us=1_000),
        usage_record("a1", created_at=oct_(3), base_us=999_999),  # a redelivery of a billed request: nothing
    ])
    october.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=12_345, created_at=oct_(31))])
    assert renders(engine, "acme", "2026-10") == before
    with Session(engine) as session:
        filed = {rid: p for rid, p in session.execute(select(Usage.request_id, Usage.invoice_period).where(Usage.tenant_id == "acme"))}
    assert filed == {"a1": "2026-10", "a2": "2026-10", "a3": "2026-11", "a4": "2026-11"}

    november = build_invoice(engine, "acme", "2026-11", CONFIG)
    labels = [line.label for line in november.lines]
    assert labels == ["x@1", "x@1 (adjustment for 2026-10)"]
    adjustment = november.lines[1]
    assert (adjustment.requests, adjustment.input_tokens, adjustment.base_ms, adjustment.lora_ms, adjustment.routing_ms) == (
        1, 1_000, Decimal("50.000"), Decimal("5.000"), Decimal("0.000"))
    # The late October load went to November's spread (October's froze at the close), over November's x@1 users.
    assert november.totals.cold_start_ms == Decimal("12.345")
    assert "x@1 (adjustment for 2026-10)" in render_table(november)


def test_close_period_freezes_every_tenant(october: Ledger, engine: Engine) -> None:
    """Closing a month closes every tenant's invoice; a tenant whose first usage of the month arrives later is billed next month."""
    invoices = close_period(engine, CONFIG, "2026-10", now=NOV_2)
    assert [(i.tenant, i.status) for i in invoices] == [("acme", "closed"), ("globex", "closed")]
    october.record_usage([usage_record("n1", tenant_id="newco", created_at=oct_(31), base_us=3_000)])
    assert build_invoice(engine, "newco", "2026-10", CONFIG).status == "closed"
    assert build_invoice(engine, "newco", "2026-10", CONFIG).lines == ()
    late = build_invoice(engine, "newco", "2026-11", CONFIG)
    assert [(line.label, line.base_ms) for line in late.lines] == [("base (adjustment for 2026-10)", Decimal("3.000"))]


def test_closing_twice_changes_nothing(october: Ledger, engine: Engine) -> None:
    """Closing is idempotent: a second close (of the invoice or of the month) returns the same frozen invoice and stores nothing new."""
    first = close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    assert close_invoice(engine, CONFIG, "acme", "2026-10", now=DEC_2) == first
    by_period = {i.tenant: i for i in close_period(engine, CONFIG, "2026-10", now=DEC_2)}
    assert by_period["acme"] == first
    assert close_period(engine, CONFIG, "2026-10", now=DEC_2) == list(by_period.values())
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(ClosedInvoice)) == 2


def test_late_usage_skips_closed_periods(october: Ledger, engine: Engine) -> None:
    """Late usage goes to the first period after its own whose invoice is still open, skipping every closed one."""
    close_invoice(engine, CONFIG, "acme", "2026-10", now=DEC_2)
    close_invoice(engine, CONFIG, "acme", "2026-11", now=DEC_2)
    october.record_usage([usage_record("late", created_at=oct_(15), base_us=1_000)])
    december = build_invoice(engine, "acme", "2026-12", CONFIG)
    assert [line.label for line in december.lines] == ["base (adjustment for 2026-10)"]
    assert build_invoice(engine, "acme", "2026-11", CONFIG).lines == ()


def test_cold_start_spread_is_frozen_at_the_first_close(october: Ledger, engine: Engine) -> None:
    """Conservation across closes: the shares of x@1's 40_000 us load, frozen when acme closed, still add up to it after globex's later usage."""
    acme = close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    # 300 : 100 tokens -> 30_000 : 10_000 us.
    assert acme.lines[-1].adapter == "x@1" and acme.lines[-1].cold_start_ms == Decimal("30.000")
    october.record_usage([usage_record("g2", tenant_id="globex", created_at=oct_(20), adapter="x@1", adapter_sha256=S1, input_tokens=10**6)])
    globex = build_invoice(engine, "globex", "2026-10", CONFIG)
    assert globex.status == "draft" and globex.totals.requests == 2  # globex's invoice is still open: g2 is on it
    assert globex.totals.cold_start_ms == Decimal("10.000")  # but the spread is frozen
    with Session(engine) as session:
        assert session.scalar(select(func.sum(ColdStartShare.share_us)).where(ColdStartShare.period == "2026-10")) == 40_000
    assert sum(i.totals.cold_start_ms for i in period_invoices(engine, "2026-10", CONFIG)) == Decimal("40.000")


def test_closed_invoice_money_is_decimal(october: Ledger, engine: Engine) -> None:
    """Money as Decimal: a frozen invoice reads back every amount as a Decimal with its exact value, never a float."""
    draft = build_invoice(engine, "acme", "2026-10", CONFIG)
    closed = close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    assert closed.totals == draft.totals and closed.lines == draft.lines
    for amounts in (*closed.lines, closed.totals):
        for name in ("base_ms", "lora_ms", "routing_ms", "kv_saved_ms", "cold_start_ms", "gpu_ms", "cost", "revenue"):
            assert type(getattr(amounts, name)) is Decimal, name
    assert all(type(line.gpu_price_per_hour) is Decimal for line in closed.lines)
    # acme: a1 12_000 + 30_000 cold, a2 5_000 -> 47_000 us at 2e-9 per us.
    assert closed.totals.cost == Decimal("0.000094000")


def test_a_month_of_a_billion_or_more_closes_on_both_backends(ledger: Ledger, engine: Engine) -> None:
    """An invoice of 10^9 currency units or more is frozen and read back exactly: 37 GPUs for 30 days at 40,000 IDR an hour
    is 1,065,600,000, and 0.001 more for 90 us (PostgreSQL's numeric(18, 9) refused it; SQLite took it)."""
    idr = LedgerConfig(url=str(engine.url), gpu_price_per_hour=Decimal("40000"), currency="IDR")
    gpu_month_us = 30 * 24 * 3_600_000_000
    ledger.record_usage([usage_record(f"r{i}", created_at=oct_(1 + i % 28), base_us=gpu_month_us) for i in range(37)]
                        + [usage_record("tip", created_at=oct_(9), base_us=90)])  # 90 us at 40_000 / 3.6e9 per us = 0.001
    draft = build_invoice(engine, "acme", "2026-10", idr)
    assert draft.totals.cost == Decimal("1065600000.001000000")
    closed = close_period(engine, idr, "2026-10", now=NOV_2)
    assert [i.totals.cost for i in closed] == [draft.totals.cost] and closed[0].lines == draft.lines
    assert build_invoice(engine, "acme", "2026-10", idr).totals == draft.totals


def test_closing_an_unknown_tenant_stores_nothing(october: Ledger, engine: Engine) -> None:
    """Closing the invoice of a tenant nobody knows is refused, naming it, and leaves no closed (empty) invoice and no frozen spread behind."""
    with pytest.raises(UnknownTenantError, match="tenant 'initech' is unknown"):
        close_invoice(engine, CONFIG, "initech", "2026-10", now=NOV_2)
    with Session(engine) as session:
        assert session.scalar(select(func.count()).select_from(ClosedInvoice)) == 0
        assert session.scalar(select(func.count()).select_from(ColdStartShare)) == 0
    assert build_invoice(engine, "acme", "2026-10", CONFIG).status == "draft"


@pytest.mark.parametrize("period", ["9999-12", "0000-01"])
def test_closing_a_month_that_cannot_be_billed_is_refused(october: Ledger, engine: Engine, period: str) -> None:
    """A month without an instant to start or end at is refused by name, for one invoice and for the whole month."""
    for close in (lambda: close_period(engine, CONFIG, period, now=NOV_2), lambda: close_invoice(engine, CONFIG, "acme", period, now=NOV_2)):
        with pytest.raises(UnbillablePeriodError, match=f"period {period} cannot be billed"):
            close()



def test_close_freezes_the_cold_start_spread_the_draft_showed(ledger: Ledger, engine: Engine) -> None:
    """Closing changes no figure of the draft it freezes: the spread does not depend on price entries that change no GPU price.

    Two 1 us loads of x@1, on the 5th and the 15th at one GPU price, used by acme and globex with 5 tokens each. A token
    price set on the 10th cut the draft's spread into two groups, each of whose 1 us went to acme (ties go to the smaller
    key): the draft billed acme 2 us and globex 0; the close, whose spread ignores token prices, 1 us each.
    """
    set_token_price(engine, "standard", Decimal(1), Decimal(1), date(2026, 10, 10), currency="USD")
    ledger.record_usage([usage_record("r", tenant_id=tenant, created_at=oct_(20), adapter="x@1", adapter_sha256=S1, input_tokens=5)
                         for tenant in ("acme", "globex")])
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=1, created_at=oct_(day)) for day in (5, 15)])
    drafts = period_invoices(engine, "2026-10", CONFIG, now=NOV_2)
    assert [i.totals.cold_start_ms for i in drafts] == [Decimal("0.001"), Decimal("0.001")]
    closed = close_period(engine, CONFIG, "2026-10", now=NOV_2)
    assert [render_json(i) for i in closed] == [render_json(replace(i, status="closed", closed_at=c.closed_at))
                                                for i, c in zip(drafts, closed, strict=True)]


def test_a_tenant_whose_share_of_a_load_is_nothing_gets_no_line(ledger: Ledger, engine: Engine) -> None:
    """A tenant whose requests of an adapter had no token while others' had some carries none of its load, and its invoice
    shows no line for it: the spread stored a 0 us share, which made a line of zeros at the load's GPU price, in the draft
    and frozen into the closed invoice."""
    set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 10, 10), currency="USD")
    ledger.record_usage([
        usage_record("a", created_at=oct_(20), adapter="x@1", adapter_sha256=S1, input_tokens=5),
        usage_record("g", tenant_id="globex", created_at=oct_(20), adapter="x@1", adapter_sha256=S1, status="failed"),
    ])
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=40_000, created_at=oct_(5))])
    for invoices in (period_invoices(engine, "2026-10", CONFIG, now=NOV_2), close_period(engine, CONFIG, "2026-10", now=NOV_2)):
        acme, globex = invoices
        assert [(line.gpu_price_per_hour, line.cold_start_ms) for line in acme.lines] == [(Decimal("3.60"), 0), (PRICE, Decimal("40.000"))]
        assert [(line.gpu_price_per_hour, line.requests, line.cold_start_ms) for line in globex.lines] == [(Decimal("3.60"), 1, 0)]
    with Session(engine) as session:
        assert session.scalars(select(ColdStartShare.tenant_id)).all() == ["acme"]


def test_a_nothing_share_frozen_by_an_earlier_version_makes_no_line(october: Ledger, engine: Engine) -> None:
    """A 0 us share that a spread frozen before this version stored makes no line on the drafts still read from it."""
    close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    with Session(engine) as session, session.begin():
        session.add(ColdStartShare(period="2026-10", tenant_id="globex", adapter="y@1", adapter_sha256=S1, gpu_price_per_hour=PRICE, share_us=0))
    assert [line.adapter for line in build_invoice(engine, "globex", "2026-10", CONFIG, now=NOV_2).lines] == ["x@1"]


def test_a_month_is_closed_in_one_currency(october: Ledger, engine: Engine) -> None:
    """Once an invoice of a month is closed, the rest of the month closes in its currency or not at all.

    acme closed in USD, then ledger.currency set to EUR: `--close-period` froze globex in EUR beside it, and the month's
    finance report was refused for good (closed invoices never change; its advice, set ledger.currency, could not help).
    """
    eur = CONFIG.model_copy(update={"currency": "EUR"})
    close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    for close in (lambda: close_period(engine, eur, "2026-10", now=NOV_2), lambda: close_invoice(engine, eur, "globex", "2026-10", now=NOV_2)):
        with pytest.raises(MixedCurrencyError, match=r"2026-10 .*closed in USD.*ledger.currency is EUR.*currency = \"USD\""):
            close()
    with Session(engine) as session:
        assert session.scalars(select(ClosedInvoice.tenant_id)).all() == ["acme"]
    assert close_invoice(engine, eur, "acme", "2026-10", now=NOV_2).currency == "USD"  # already closed: returned as frozen
    assert [(i.tenant, i.currency) for i in close_period(engine, CONFIG, "2026-10", now=NOV_2)] == [("acme", "USD"), ("globex", "USD")]
    assert [i.currency for i in close_period(engine, eur, "2026-10", now=NOV_2)] == ["USD", "USD"]  # closed: nothing to freeze
    assert finance_report(engine, "2026-10", eur).currency == "USD"


def test_a_tenant_with_nothing_in_a_closed_month_has_the_months_currency(october: Ledger, engine: Engine) -> None:
    """October closed in USD; a registered tenant that used nothing in it gets an empty closed invoice. Read under
    ledger.currency = EUR it said EUR (today's currency) beside acme's and globex's USD, for the same closed month."""
    with Session(engine) as session, session.begin():
        session.add(Tenant(id="idle", display_name="Idle", tier="standard"))
    close_period(engine, CONFIG, "2026-10", now=NOV_2)
    eur = CONFIG.model_copy(update={"currency": "EUR"})
    empty = build_invoice(engine, "idle", "2026-10", eur)
    assert (empty.status, empty.totals.requests, empty.currency) == ("closed", 0, "USD")
    assert close_invoice(engine, eur, "idle", "2026-10", now=NOV_2).currency == "USD"
