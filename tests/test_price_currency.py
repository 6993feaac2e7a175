"""Price-list entries carry the currency they were set in (revision 0012); a closed month's prices are final.

Invoices price only with entries of their own currency (ledger.currency): after a switch from EUR to USD, an open
month's draft was labelled USD and priced with the EUR numbers. And a price set for days of a month closed for every
tenant changed none of its invoices but repriced its late usage's adjustment lines on the next open month.
Runs on SQLite and the machine's PostgreSQL.
"""

from __future__ import annotations

from datetime import date
from decimal import Decimal

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from billing.closing import close_invoice, close_period
from billing.errors import PriceCurrencyError, PriceError
from billing.finance import finance_report
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.prices import gpu_price_list, set_gpu_price, set_token_price, token_price_list
from tests.test_closing import CONFIG, DEC_2, NOV_2, PRICE, S1, ledger, nov, oct_, october  # noqa: F401  (fixtures)
from tests.test_ledger import usage_record

EUR = CONFIG.model_copy(update={"currency": "EUR"})
USD = CONFIG  # ledger.currency's default


def test_setting_a_price_records_its_currency(engine: Engine) -> None:
    """Each entry keeps the currency it was set in; setting its day again replaces the currency with the price."""
    set_gpu_price(engine, "default", Decimal("3.00"), date(2026, 10, 1), currency="EUR")
    set_gpu_price(engine, "default", Decimal("2.00"), date(2026, 11, 1), currency="EUR")
    set_gpu_price(engine, "default", Decimal("2.20"), date(2026, 11, 1), currency="USD")
    set_token_price(engine, "standard", Decimal("0.1"), Decimal("0.2"), date(2026, 10, 1), currency="EUR")
    with Session(engine) as session:
        gpu, tokens = gpu_price_list(session), token_price_list(session)
    assert [(g.effective_from.date(), g.price_per_hour, g.currency) for g in gpu] == [
        (date(2026, 10, 1), Decimal("3.00"), "EUR"), (date(2026, 11, 1), Decimal("2.20"), "USD")]
    assert [t.currency for t in tokens] == ["EUR"]


def test_a_draft_is_never_priced_in_one_currency_and_labelled_in_another(ledger: Ledger, engine: Engine) -> None:
    """EUR prices from October 1; ledger.currency switched to USD: November's draft (and its close, and the finance report)
    is refused, naming both currencies and the fix, until November's days have USD prices; then it is priced with those."""
    set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 10, 1), currency="EUR")
    ledger.record_usage([usage_record("n1", created_at=nov(3), base_us=1_000_000)])
    assert build_invoice(engine, "acme", "2026-11", EUR, now=DEC_2).totals.cost == Decimal("0.001000000")  # in EUR: fine
    refusal = (r"default GPU price in effect from 2026-10-01 was set in EUR, and this invoice is in ledger.currency USD.*"
               r"Set USD prices .*`lorabatch prices set-gpu default PRICE --from DAY`.*or invoice it with ledger.currency = \"EUR\"")
    for priced in (lambda: build_invoice(engine, "acme", "2026-11", USD, now=DEC_2),
                   lambda: finance_report(engine, "2026-11", USD, now=DEC_2),
                   lambda: close_invoice(engine, USD, "acme", "2026-11", now=DEC_2),
                   lambda: close_period(engine, USD, "2026-11", now=DEC_2)):
        with pytest.raises(PriceCurrencyError, match=refusal):
            priced()
    assert build_invoice(engine, "acme", "2026-11", EUR, now=DEC_2).status == "draft"  # nothing was closed
    set_gpu_price(engine, "default", Decimal("7.20"), date(2026, 11, 1), currency="USD")
    invoice = close_invoice(engine, USD, "acme", "2026-11", now=DEC_2)
    assert (invoice.currency, [line.gpu_price_per_hour for line in invoice.lines], invoice.totals.cost) == (
        "USD", [Decimal("7.20")], Decimal("0.002000000"))


def test_token_prices_of_another_currency_are_refused_not_counted_unpriced(ledger: Ledger, engine: Engine) -> None:
    """A tier whose entry in effect is in EUR earns nothing in a USD invoice only by mistake: it is refused, naming the tier."""
    set_token_price(engine, "standard", Decimal("1"), Decimal("1"), date(2026, 10, 1), currency="EUR")
    ledger.record_usage([usage_record("n1", created_at=nov(3), input_tokens=10**6, tier="standard")])
    with pytest.raises(PriceCurrencyError, match=r"standard token price in effect from 2026-10-01 was set in EUR.*ledger.currency USD.*"
                                                 r"prices set-tokens standard --input P --output P --from DAY"):
        build_invoice(engine, "acme", "2026-11", USD, now=DEC_2)
    assert build_invoice(engine, "acme", "2026-11", EUR, now=DEC_2).totals.revenue == Decimal("1.000000000")


def test_a_worker_writes_its_row_whatever_the_currency_of_the_price(ledger: Ledger, engine: Engine) -> None:
    """The row's own cost at insert is informational: an entry of another currency leaves it at the fallback price,
    and the row is written (only invoices refuse it)."""
    set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 10, 1), currency="EUR")
    ledger.record_usage([usage_record("n1", created_at=nov(3), base_us=1_000_000)])
    assert ledger.usage_for("acme", "n1").cost == Decimal("0.002000000")  # type: ignore[union-attr]  # at PRICE, 7.20


def test_a_price_for_days_of_a_closed_month_is_refused(october: Ledger, engine: Engine) -> None:
    """October closed for every tenant: a GPU or token price whose days reach it is refused, naming the month, that it
    is closed and where a correction goes. It changed no October invoice, only the November line "adjustment for
    2026-10" that its late usage is billed on (measured before: the late line's price went from 7.20 to 3.60)."""
    set_gpu_price(engine, "default", PRICE, date(2026, 10, 20), currency="USD")
    close_period(engine, USD, "2026-10", now=NOV_2)
    october.record_usage([usage_record("late", created_at=oct_(25), base_us=1_000_000)])
    before = build_invoice(engine, "acme", "2026-11", USD, now=DEC_2)
    assert [(line.adjustment_for, line.gpu_price_per_hour) for line in before.lines] == [("2026-10", PRICE)]
    refused = r"from 2026-\d\d-\d\d would change the prices of 2026-10, which is closed.*next open month's adjustment lines.*"
    for day in (date(2026, 10, 20), date(2026, 10, 25), date(2026, 9, 15)):  # Sept 15 runs to Oct 20, the next entry
        with pytest.raises(PriceError, match=refused + r"set the price from 2026-11-01 or later \(`lorabatch prices set-gpu default"):
            set_gpu_price(engine, "default", Decimal("3.60"), day, currency="USD")
        with pytest.raises(PriceError, match=refused + r"from 2026-11-01 or later \(`lorabatch prices set-tokens standard"):
            set_token_price(engine, "standard", Decimal(1), Decimal(1), day, currency="USD")
    assert build_invoice(engine, "acme", "2026-11", USD, now=DEC_2) == before
    with Session(engine) as session:
        assert [(g.effective_from.date(), g.price_per_hour) for g in gpu_price_list(session)] == [(date(2026, 10, 20), PRICE)]
        assert token_price_list(session) == []
    set_gpu_price(engine, "default", Decimal("3.60"), date(2026, 11, 1), currency="USD")  # an open month: taken
    set_token_price(engine, "standard", Decimal(1), Decimal(1), date(2026, 11, 1), currency="USD")
    assert build_invoice(engine, "acme", "2026-11", USD, now=DEC_2) == before  # the late line keeps October's price
