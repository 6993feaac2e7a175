"""Price lists: the GPU and token prices in effect at each usage row's created_at; revenue; the fallback.

Runs on SQLite and the machine's PostgreSQL.
"""

from __future__ import annotations

from datetime import date, datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from billing.config import LedgerConfig
from billing.errors import PriceError
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.prices import gpu_price_list, set_gpu_price, set_token_price, token_price_list
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("3.60"), gpu_kind="h100")  # fallback: 1e-9 per us


def at(month: int, day: int, hour: int = 0, minute: int = 0) -> datetime:
    return datetime(2026, month, day, hour, minute, tzinfo=timezone.utc)


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    with engine.begin() as connection:
        connection.execute(text("INSERT INTO tenants (id, display_name, tier) VALUES ('acme', 'Acme', 'premium'), ('globex', 'Globex', 'standard')"))
    return Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))


def test_gpu_price_in_effect_at_created_at(ledger: Ledger, engine: Engine) -> None:
    """Each row is charged the GPU price in effect at its created_at (from midnight UTC of the entry's day); a change mid-month splits the line."""
    set_gpu_price(engine, "h100", Decimal("7.20"), date(2026, 3, 1), currency="USD")  # 2e-9 per us
    set_gpu_price(engine, "h100", Decimal("10.80"), date(2026, 3, 16), currency="USD")  # 3e-9 per us
    set_gpu_price(engine, "a10", Decimal("1000"), date(2026, 1, 1), currency="USD")  # another kind: never applies here
    ledger.record_usage([
        usage_record("before", created_at=at(2, 28, 23, 59), base_us=1_000_000),  # February: fallback
        usage_record("early", created_at=at(3, 15, 23, 59), base_us=1_000_000),
        usage_record("late", created_at=at(3, 16), base_us=2_000_000),
    ])
    march = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert [(line.gpu_price_per_hour, line.base_ms, line.cost) for line in march.lines] == [
        (Decimal("7.20"), Decimal("1000.000"), Decimal("0.002000000")),
        (Decimal("10.80"), Decimal("2000.000"), Decimal("0.006000000")),
    ]
    assert march.totals.cost == Decimal("0.008000000")
    february = build_invoice(engine, "acme", "2026-02", CONFIG)
    assert [(line.gpu_price_per_hour, line.cost) for line in february.lines] == [(Decimal("3.60"), Decimal("0.001000000"))]
    # The row's own cost column is priced the same way at insert.
    assert ledger.usage_for("acme", "late").cost == Decimal("0.006000000")  # type: ignore[union-attr]


def test_token_revenue_by_tier(ledger: Ledger, engine: Engine) -> None:
    """Revenue = succeeded input tokens x input price / 1e6 + output x output price / 1e6, at the tenant tier's price of the day; failed requests earn nothing."""
    set_token_price(engine, "premium", Decimal("0.50"), Decimal("1.50"), date(2026, 3, 1), currency="USD")
    set_token_price(engine, "premium", Decimal("0.40"), Decimal("1.00"), date(2026, 3, 10), currency="USD")
    set_token_price(engine, "standard", Decimal("0.10"), Decimal("0.30"), date(2026, 3, 1), currency="USD")
    ledger.record_usage([
        usage_record("p1", created_at=at(3, 5), input_tokens=1_000_000, output_tokens=200_000),  # 0.50 + 0.30
        usage_record("p2", created_at=at(3, 12), input_tokens=3, output_tokens=7),  # at 0.40 / 1.00: 0.0000012 + 0.000007
        usage_record("p3", created_at=at(3, 12), status="failed", input_tokens=10**6, output_tokens=10**6),  # nothing
        usage_record("s1", tenant_id="globex", created_at=at(3, 5), input_tokens=10, output_tokens=10),  # 0.000001 + 0.000003
    ])
    acme = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert acme.tier == "premium" and acme.unpriced_requests == 0
    assert acme.totals.revenue == Decimal("0.800008200")
    assert type(acme.totals.revenue) is Decimal
    globex = build_invoice(engine, "globex", "2026-03", CONFIG)
    assert globex.totals.revenue == Decimal("0.000004000")


def test_tokens_without_a_price_are_unpriced_not_guessed(ledger: Ledger, engine: Engine) -> None:
    """Before a tier's first entry, or for a tenant not in the registry, tokens earn nothing and are counted as unpriced."""
    set_token_price(engine, "premium", Decimal("1"), Decimal("1"), date(2026, 3, 10), currency="USD")
    ledger.record_usage([
        usage_record("early", created_at=at(3, 9, 23, 59), input_tokens=10**6),
        usage_record("priced", created_at=at(3, 10), input_tokens=10**6),
        usage_record("x", tenant_id="unregistered", created_at=at(3, 10), input_tokens=10**6),
    ])
    acme = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert (acme.totals.revenue, acme.unpriced_requests) == (Decimal("1.000000000"), 1)
    other = build_invoice(engine, "unregistered", "2026-03", CONFIG)
    assert (other.tier, other.totals.revenue, other.unpriced_requests) == (None, Decimal("0E-9"), 1)


def test_setting_a_day_again_replaces_it(engine: Engine) -> None:
    """One entry per kind (or tier) and day: setting it again replaces the price; list_prices shows them by date."""
    set_gpu_price(engine, "h100", Decimal("2.00"), date(2026, 3, 1), currency="USD")
    set_gpu_price(engine, "h100", Decimal("2.25"), date(2026, 3, 1), currency="USD")
    set_gpu_price(engine, "h100", Decimal("1.75"), date(2026, 1, 1), currency="USD")
    set_token_price(engine, "std", Decimal("0.1"), Decimal("0.2"), date(2026, 3, 1), currency="USD")
    set_token_price(engine, "std", Decimal("0.3"), Decimal("0.4"), date(2026, 3, 1), currency="USD")
    with Session(engine) as session:
        gpu, tokens = gpu_price_list(session), token_price_list(session)
    assert [(g.effective_from, g.price_per_hour) for g in gpu] == [(at(1, 1), Decimal("1.75")), (at(3, 1), Decimal("2.25"))]
    assert [(t.input_per_million, t.output_per_million) for t in tokens] == [(Decimal("0.3"), Decimal("0.4"))]


@pytest.mark.parametrize(
    ("price", "hint"),
    [(Decimal("-1"), "negative"), (Decimal("0.0000000001"), "more than 9 decimal places"), (Decimal("NaN"), "not a price"), (2.5, "not a price"),
     (Decimal("1e30"), "too large"), (Decimal("1E+400"), "too large"), (Decimal("-1E+400"), "negative")],
)
def test_bad_prices_are_refused(engine: Engine, price: Decimal, hint: str) -> None:
    """A price that is negative, too precise, too large or not a Decimal is refused with an error that says how to write it
    (one of 10^28 or more, as `prices set-gpu h100 1e30` gives, ended the command in decimal.InvalidOperation)."""
    with pytest.raises(PriceError, match=hint):
        set_gpu_price(engine, "h100", price, date(2026, 1, 1), currency="USD")
    with pytest.raises(PriceError, match="cannot name a price list"):
        set_token_price(engine, " ", Decimal(1), Decimal(1), date(2026, 1, 1), currency="USD")


def test_money_keeps_every_digit(engine: Engine) -> None:
    """Money as Decimal: an 18-digit amount reads back exactly on both backends (SQLite keeps it as text, not a double)."""
    price = Decimal("123456789.123456789")  # a double holds ~15-17 significant digits
    set_gpu_price(engine, "big", price, date(2026, 1, 1), currency="USD")
    with Session(engine) as session:
        (entry,) = gpu_price_list(session, "big")
    assert type(entry.price_per_hour) is Decimal and entry.price_per_hour == price
