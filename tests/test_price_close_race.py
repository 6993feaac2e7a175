"""A price set while a close runs: either the price is refused (the month closed first) or the close prices with it.

`prices set-gpu` read whether the month was closed, then wrote its entry; a close committed between the two froze the
month at the old price and the entry landed in a closed month (PostgreSQL), or the setter failed with "database is
locked" (SQLite). billing.filing.lock_price_lists orders the two.
"""

from __future__ import annotations

import threading
from datetime import date
from decimal import Decimal

import pytest
from sqlalchemy import Engine

import billing.prices as prices
from billing.closing import close_invoice, close_period
from billing.errors import PriceError
from billing.invoice import build_invoice
from billing.ledger import Ledger
from tests.test_closing import CONFIG, NOV_2, PRICE, ledger, october  # noqa: F401  (fixtures)

NEW = Decimal("3.60")


@pytest.mark.parametrize("close", ["period", "acme"])
def test_a_close_between_a_price_check_and_its_write_never_leaves_the_month_at_the_old_price(
        october: Ledger, engine: Engine, monkeypatch: pytest.MonkeyPatch, close: str) -> None:
    """The close runs in another thread just after `set_gpu_price` found October open, and is given up to 2 s to finish
    before the setter writes. Before: it finished, October's invoices froze at 7.20 and the 3.60 entry for October's
    days was written after them (PostgreSQL), or the setter failed on SQLite's stale snapshot. After: the close waits for
    the setter's transaction and prices October at 3.60."""
    done: list[object] = []

    def run_close() -> None:
        try:
            done.append(close_period(engine, CONFIG, "2026-10", now=NOV_2) if close == "period"
                        else close_invoice(engine, CONFIG, "acme", "2026-10", now=NOV_2))
        except Exception as e:  # noqa: BLE001 - asserted below
            done.append(e)

    checked = prices._refuse_a_split_month

    def check_then_close(*args: object) -> None:
        checked(*args)
        closer = threading.Thread(target=run_close)
        closer.start()
        closer.join(timeout=2)  # it either finishes or waits on the setter's lock
        threads.append(closer)

    threads: list[threading.Thread] = []
    monkeypatch.setattr(prices, "_refuse_a_split_month", check_then_close)
    try:
        prices.set_gpu_price(engine, "default", NEW, date(2026, 10, 1), currency="USD")
        taken = True
    except PriceError:
        taken = False
    for thread in threads:
        thread.join()
    assert len(done) == 1 and not isinstance(done[0], Exception), done
    invoice = build_invoice(engine, "acme", "2026-10", CONFIG)
    assert invoice.status == "closed"
    assert {line.gpu_price_per_hour for line in invoice.lines} == {NEW if taken else PRICE}
