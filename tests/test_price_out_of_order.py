"""Months closed out of order: a price for an open month before a closed one stops at the closed one (billing.prices).

An entry's days run to the next entry of its kind or tier. After November's close (for everyone, or for some tenants),
every entry for October's days with no entry of November 1 ran into November and was refused, whatever it was: no
October price could be set again, and October usage on a GPU kind with no price could be neither drafted nor closed
(finance audit: "close a later month first and the earlier one is frozen unbillable"). Now such an entry stops at the
closed month: the price in effect there before is written again from its first day, so the closed month's prices stay
final and the entry prices only the open days before it.
"""

from __future__ import annotations

import json
from datetime import date, datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session
from typer.testing import CliRunner

from billing import db
from billing.closing import close_invoice, close_period
from billing.config import LedgerConfig
from billing.errors import PriceError, UnpricedGpuKindError
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.prices import gpu_price_list, set_gpu_price, set_token_price, token_price_list
from consumer.cli import build_app
from migrations import SCRIPT_LOCATION
from tests.test_closing import CONFIG, PRICE, ledger  # noqa: F401  (fixture)
from tests.test_ledger import usage_record

HOUR_US = 3_600_000_000
DEC_2 = datetime(2026, 12, 2, tzinfo=timezone.utc)
JAN_2 = datetime(2027, 1, 2, tzinfo=timezone.utc)
FALLBACK = (CONFIG.gpu_kind, PRICE)  # what the CLI passes: ledger.gpu_kind and ledger.gpu_price_per_hour


def at(month: int, day: int = 10) -> datetime:
    return datetime(2026, month, day, 12, tzinfo=timezone.utc)


def _gpu(engine: Engine, kind: str = "default") -> list[tuple[date, Decimal]]:
    with Session(engine) as session:
        return [(e.effective_from.date(), e.price_per_hour) for e in gpu_price_list(session, kind)]


@pytest.fixture
def november_closed(ledger: Ledger, engine: Engine) -> Ledger:  # noqa: F811
    """One GPU hour of acme's in each of October, November and December at 2.50 (from January 1); November closed first."""
    set_gpu_price(engine, "default", Decimal("2.50"), date(2026, 1, 1), currency="USD")
    ledger.record_usage([usage_record(f"r{m}", created_at=at(m), base_us=HOUR_US) for m in (10, 11, 12)])
    close_period(engine, CONFIG, "2026-11", now=DEC_2)
    return ledger


def test_an_october_price_after_novembers_close_stops_at_november(november_closed: Ledger, engine: Engine) -> None:
    """Refused before (its days reached November). Now October is priced at 3.00, November keeps 2.50, and so do its
    late usage (on December's adjustment line) and December itself."""
    closed = build_invoice(engine, "acme", "2026-11", CONFIG)
    entry = set_gpu_price(engine, "default", Decimal("3.00"), date(2026, 10, 1), currency="USD")
    assert entry.stops_at == datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert _gpu(engine) == [(date(2026, 1, 1), Decimal("2.5")), (date(2026, 10, 1), Decimal("3")), (date(2026, 11, 1), Decimal("2.5"))]
    assert build_invoice(engine, "acme", "2026-10", CONFIG).totals.cost == Decimal("3")
    assert build_invoice(engine, "acme", "2026-11", CONFIG) == closed
    november_closed.record_usage([usage_record("late", created_at=at(11, 20), base_us=HOUR_US)])
    december = build_invoice(engine, "acme", "2026-12", CONFIG)
    assert [(line.adjustment_for, line.cost) for line in december.lines] == [(None, Decimal("2.5")), ("2026-11", Decimal("2.5"))]
    # Set again, the entry replaces itself and finds November's own entry: nothing more is written.
    assert set_gpu_price(engine, "default", Decimal("3.10"), date(2026, 10, 1), currency="USD").stops_at is None
    assert [p for _, p in _gpu(engine)] == [Decimal("2.5"), Decimal("3.1"), Decimal("2.5")]
    assert close_period(engine, CONFIG, "2026-10", now=DEC_2)[0].totals.cost == Decimal("3.1")
    with pytest.raises(PriceError, match="would change the prices of 2026-11, which is closed"):  # November's own days: final
        set_gpu_price(engine, "default", Decimal("5"), date(2026, 11, 1), currency="USD")


def test_a_month_closed_for_one_tenant_stops_the_entry_too(ledger: Ledger, engine: Engine) -> None:  # noqa: F811
    """November closed for acme only (its spread frozen): an October entry stops at it, globex's draft unchanged."""
    set_gpu_price(engine, "default", Decimal("2.50"), date(2026, 1, 1), currency="USD")
    ledger.record_usage([usage_record(f"{t}{m}", tenant_id=t, created_at=at(m), base_us=HOUR_US) for t in ("acme", "globex") for m in (10, 11)])
    close_invoice(engine, CONFIG, "acme", "2026-11", now=DEC_2)
    globex = build_invoice(engine, "globex", "2026-11", CONFIG)
    assert set_gpu_price(engine, "default", Decimal("3.00"), date(2026, 10, 1), currency="USD").stops_at == datetime(2026, 11, 1, tzinfo=timezone.utc)
    assert build_invoice(engine, "globex", "2026-11", CONFIG) == globex
    assert build_invoice(engine, "globex", "2026-10", CONFIG).totals.cost == Decimal("3")


def test_the_fallback_price_is_what_the_closed_month_keeps(ledger: Ledger, engine: Engine) -> None:  # noqa: F811
    """No entry at all: November was closed at ledger.gpu_price_per_hour (7.20); the entry stops there and 7.20 is written
    for November 1. Without the fallback named, nothing says what November kept, so it is refused as before."""
    ledger.record_usage([usage_record(f"r{m}", created_at=at(m), base_us=HOUR_US) for m in (10, 11)])
    close_period(engine, CONFIG, "2026-11", now=DEC_2)
    with pytest.raises(PriceError, match="would change the prices of 2026-11, which is closed"):
        set_gpu_price(engine, "default", Decimal("3.00"), date(2026, 10, 1), currency="USD")
    assert _gpu(engine) == []
    set_gpu_price(engine, "default", Decimal("3.00"), date(2026, 10, 1), currency="USD", fallback=FALLBACK)
    assert _gpu(engine) == [(date(2026, 10, 1), Decimal("3")), (date(2026, 11, 1), PRICE)]
    assert build_invoice(engine, "acme", "2026-10", CONFIG).totals.cost == Decimal("3")


def test_a_kind_never_priced_can_be_priced_for_the_open_month(ledger: Ledger, engine: Engine) -> None:  # noqa: F811
    """The frozen case: October ran on h200, which has no price; November (default GPUs only) closed first. October's
    draft and close asked for an h200 price from October, and that price was refused (it ran into November) for ever.
    No closed month billed any h200 row, so nothing it billed is repriced: the price is taken and October closes."""
    ledger.record_usage([usage_record("o", created_at=at(10), gpu_kind="h200", base_us=HOUR_US),
                         usage_record("n", created_at=at(11), gpu_kind="default", base_us=HOUR_US)])
    close_period(engine, CONFIG, "2026-11", now=DEC_2)
    with pytest.raises(UnpricedGpuKindError, match="h200"):
        close_period(engine, CONFIG, "2026-10", now=DEC_2)
    set_gpu_price(engine, "h200", Decimal("4.00"), date(2026, 10, 1), currency="USD", fallback=FALLBACK)
    assert close_period(engine, CONFIG, "2026-10", now=DEC_2)[0].totals.cost == Decimal("4")


def test_a_kind_a_closed_month_billed_at_the_fallback_is_still_refused(ledger: Ledger, engine: Engine) -> None:  # noqa: F811
    """November's h200 row was billed at the fallback of a closer whose ledger.gpu_kind was h200; the setter's fallback is
    another kind's, so nothing says what November kept: refused, November's invoice as closed."""
    h200 = LedgerConfig(gpu_kind="h200", gpu_price_per_hour=Decimal("9"))
    ledger.record_usage([usage_record("o", created_at=at(10), gpu_kind="h200", base_us=HOUR_US),
                         usage_record("n", created_at=at(11), gpu_kind="h200", base_us=HOUR_US)])
    close_period(engine, h200, "2026-11", now=DEC_2)
    with pytest.raises(PriceError, match="would change the prices of 2026-11, which is closed"):
        set_gpu_price(engine, "h200", Decimal("4.00"), date(2026, 10, 1), currency="USD", fallback=FALLBACK)
    assert _gpu(engine, "h200") == []


def test_a_token_price_stops_at_a_closed_month(ledger: Ledger, engine: Engine) -> None:  # noqa: F811
    """standard at 0.20 from January; November closed; 0.50 from October 1 prices October and stops at November, whose
    late usage is still billed at 0.20 on December's adjustment line."""
    set_token_price(engine, "standard", Decimal("0.20"), Decimal("0.60"), date(2026, 1, 1), currency="USD")
    ledger.record_usage([usage_record(f"r{m}", created_at=at(m), tier="standard", input_tokens=10**6) for m in (10, 11)])
    close_period(engine, CONFIG, "2026-11", now=DEC_2)
    entry = set_token_price(engine, "standard", Decimal("0.50"), Decimal("0.60"), date(2026, 10, 1), currency="USD")
    assert entry.stops_at == datetime(2026, 11, 1, tzinfo=timezone.utc)
    with Session(engine) as session:
        assert [(e.effective_from.date(), e.input_per_million) for e in token_price_list(session)] == [
            (date(2026, 1, 1), Decimal("0.2")), (date(2026, 10, 1), Decimal("0.5")), (date(2026, 11, 1), Decimal("0.2"))]
    assert build_invoice(engine, "acme", "2026-10", CONFIG).totals.revenue == Decimal("0.5")
    ledger.record_usage([usage_record("late", created_at=at(11, 20), tier="standard", input_tokens=10**6)])
    december = build_invoice(engine, "acme", "2026-12", CONFIG, now=JAN_2)
    assert [(line.adjustment_for, line.revenue) for line in december.lines] == [("2026-11", Decimal("0.2"))]


def test_the_cli_names_the_fallback_and_says_where_the_entry_stops(tmp_path) -> None:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    try:
        Ledger(engine, LedgerConfig(url=url)).record_usage([usage_record(f"r{m}", created_at=at(m), base_us=HOUR_US) for m in (10, 11)])
        close_period(engine, LedgerConfig(url=url, gpu_kind="h100", gpu_price_per_hour=Decimal("2.50")), "2026-11", now=DEC_2)
    finally:
        engine.dispose()
    config = tmp_path / "lorabatch.toml"
    config.write_text(f'[ledger]\nurl = "{url}"\ngpu_kind = "h100"\ngpu_price_per_hour = 2.50\n[store]\nadapter_dir = "{tmp_path / "store"}"\n')
    result = CliRunner().invoke(build_app(), ["prices", "set-gpu", "h100", "3.00", "--from", "2026-10-01", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "3.00 USD per hour from 2026-10-01 (UTC) to 2026-11-01, where 2026-11 is closed" in result.stdout
    listed = json.loads(CliRunner().invoke(build_app(), ["prices", "list", "--format", "json", "--config", str(config)]).stdout)
    assert [(e["from"], e["price_per_hour"]) for e in listed["gpu"]] == [("2026-10-01", "3.00"), ("2026-11-01", "2.50")]
