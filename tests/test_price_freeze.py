"""A price may not reach a month closed for some tenants and not for others (billing.prices._refuse_a_split_month).

The month's cold-start spread is frozen, with each share's GPU price, at its first close; a GPU price set afterwards for
its days made the other tenants' drafts bill their usage at the new price and their cold-start shares at the old one.
A token price set afterwards billed a closed tenant's late usage of those days at the new price on the next month's
adjustment line, while its closed invoice had billed the same days at the old one.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from billing.closing import close_invoice, close_period
from billing.errors import PriceError
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.prices import gpu_price_list, set_gpu_price, set_token_price, token_price_list
from tests.test_closing import CONFIG, DEC_2, NOV_2, PRICE, S1, ledger, nov, oct_, october  # noqa: F401  (fixtures)
from tests.test_ledger import load_record, usage_record


def _prices(engine: Engine) -> list:
    with Session(engine) as session:
        return [(e.effective_from.date(), e.price_per_hour) for e in gpu_price_list(session, "default")]


def test_a_price_into_a_month_closed_for_one_tenant_is_refused(october: Ledger, engine: Engine) -> None:
    close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    before = build_invoice(engine, "globex", "2026-10", CONFIG, now=NOV_2)
    for day in (date(2026, 10, 1), date(2026, 10, 10), date(2026, 9, 15)):  # its days reach October
        with pytest.raises(PriceError, match=r"from 20\d\d-\d\d-\d\d would change 2026-10, whose invoices are closed for "
                                             r"some tenants .*--close-period.*or set the price from 2026-11-01"):
            set_gpu_price(engine, "default", Decimal("3.60"), day, currency="USD")
    assert _prices(engine) == [] and build_invoice(engine, "globex", "2026-10", CONFIG, now=NOV_2) == before
    set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 11, 1), currency="USD")  # from the next month: taken
    assert _prices(engine) == [(date(2026, 11, 1), Decimal("3.60"))]


def test_once_the_month_is_closed_for_everyone_a_price_for_its_days_is_refused(october: Ledger, engine: Engine) -> None:
    """Every invoice of the month keeps what it was closed with; a price for its days was taken and repriced only its late
    usage's adjustment lines on the next open month: a closed month's prices are final (tests/test_price_currency.py)."""
    closed = close_period(engine, CONFIG, "2026-10", now=NOV_2)
    with pytest.raises(PriceError, match="would change the prices of 2026-10, which is closed"):
        set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 10, 10), currency="USD")
    assert close_period(engine, CONFIG, "2026-10", now=NOV_2) == closed


def test_a_late_load_frozen_in_a_split_month_keeps_its_price(ledger: Ledger, engine: Engine) -> None:
    """October closed for everyone; a load of October 22 arrived after, so November's spread bills it; November closed
    for acme only. A price for October 22-24 (the next entries on the 21st and 25th) would reach November through that
    load: it is refused, as every price for October's days is now, October being closed (before, one for the 10th-20th
    was taken, and one for the 22nd refused naming November)."""
    for day, price in ((1, PRICE), (21, Decimal("8.00")), (25, Decimal("9.00"))):
        set_gpu_price(engine, "default", price, date(2026, 10, day), currency="USD")
    ledger.record_usage([usage_record("o", created_at=oct_(3), adapter="x@1", adapter_sha256=S1, input_tokens=5)])
    close_period(engine, CONFIG, "2026-10", now=NOV_2)
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=9_000, created_at=oct_(22))])
    ledger.record_usage([usage_record(r, tenant_id=t, created_at=nov(3), adapter="x@1", adapter_sha256=S1, input_tokens=5)
                         for r, t in (("a", "acme"), ("g", "globex"))])
    close_invoice(engine, CONFIG, "acme", "2026-11", now=DEC_2)
    for day in (10, 22):
        with pytest.raises(PriceError, match=f"from 2026-10-{day} would change the prices of 2026-10, which is closed"):
            set_gpu_price(engine, "default", Decimal("2.00"), date(2026, 10, day), currency="USD")
    with pytest.raises(PriceError, match="from 2026-11-01 would change 2026-11, .*or set the price from 2026-12-01"):
        set_gpu_price(engine, "default", Decimal("2.00"), date(2026, 11, 1), currency="USD")


def test_a_token_price_into_a_month_closed_for_one_tenant_is_refused(ledger: Ledger, engine: Engine) -> None:
    """The finance audit's case: acme's October closed at 0.20 per million input tokens; a 0.50 entry from October 1 was
    taken, and acme's late October usage was billed at 0.50 on November's "adjustment for 2026-10" line while its closed
    invoice billed the same days at 0.20. Now refused, whatever the tier (premium: no closed invoice billed any)."""
    set_token_price(engine, "standard", Decimal("0.20"), Decimal("0.60"), date(2026, 1, 1), currency="USD")
    ledger.record_usage([usage_record(f"r-{t}", tenant_id=t, created_at=oct_(5), tier="standard", input_tokens=1_000_000)
                         for t in ("acme", "globex")])
    close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2)
    # (An entry of September 15 stops at October 1, where the price in effect is set again: tests/test_price_out_of_order.py.)
    for tier, day in (("standard", date(2026, 10, 1)), ("premium", date(2026, 10, 20))):
        with pytest.raises(PriceError, match=rf"a {tier} token price from {day} would change 2026-10, whose invoices are "
                                             r"closed for some tenants .*--close-period.*or set the price from 2026-11-01"):
            set_token_price(engine, tier, Decimal("0.50"), Decimal("0.60"), day, currency="USD")
    with Session(engine) as session:
        assert [(e.tier, e.effective_from.date()) for e in token_price_list(session)] == [("standard", date(2026, 1, 1))]
    ledger.record_usage([usage_record("late", created_at=oct_(5), tier="standard", input_tokens=1_000_000)])
    adjustment = [line for line in build_invoice(engine, "acme", "2026-11", CONFIG, now=DEC_2).lines if line.adjustment_for == "2026-10"]
    assert [line.revenue for line in adjustment] == [Decimal("0.2")]  # the price acme's October closed with
    assert build_invoice(engine, "globex", "2026-10", CONFIG, now=NOV_2).totals.revenue == Decimal("0.2")
    set_token_price(engine, "standard", Decimal("0.50"), Decimal("0.60"), date(2026, 11, 1), currency="USD")  # the next month: taken
