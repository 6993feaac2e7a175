"""Which period's invoice bills a row: its own, or the next open one when its own was closed before it arrived.

A usage row belongs to the UTC month of its created_at. While its tenant's invoice of that month is
open, that invoice bills it. Once the invoice is closed (or the whole period is), the invoice never
changes again, and a row that arrives afterwards -- a slow worker's flush, a redelivered job that was
never written -- is billed on the tenant's next open period instead, where it shows as an adjustment
line for its own month. Adapter loads follow the same rule against the period's cold-start spread:
once a spread is frozen, a late load goes into the next period's spread.

Writers and closers agree through one row per period in billing_periods: a writer holds the rows of
the periods it files into FOR SHARE until it commits, a closer holds its period's row FOR UPDATE. So a
close waits for writes already filing into its period and sees them, and writes that come after the
close see it closed. On SQLite the database's single write lock does the same: every writer's first
statement here is a write, which takes that lock before anything is read.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from sqlalchemy import select, text, tuple_
from sqlalchemy.orm import Session

from billing.db import dialect_insert
from billing.models import BillingPeriod, ClosedInvoice
from billing.periods import next_period


# PostgreSQL advisory lock key ordering price-list changes against closes ("lbpr").
_PG_PRICE_LISTS_LOCK = 0x6C62_7072


def lock_price_lists(session: Session, *, exclusive: bool) -> None:
    """Order this transaction against closes and price-list changes: `exclusive` for a price setter, shared for a closer.
    Call it first in the transaction.

    A setter checks that the days of its entry reach no closed month, then writes it. A close committed between the
    two (measured: one run in that gap, tests/test_price_close_race.py) froze the month at the old price and the new
    entry landed on a closed month, which README's Billing says is refused. Taken first, the lock makes a close wait
    for the setter's commit (and price with its entry) or the setter wait for the close (and refuse). Closes of
    different months share it. SQLite has one write lock: both take it at BEGIN IMMEDIATE (pysqlite opens no
    transaction for a SELECT, so the setter's checks read outside any, and the close's write slipped between them).
    """
    connection = session.connection()
    if connection.dialect.name == "postgresql":
        function = "pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared"
        session.execute(text(f"SELECT {function}(:key)"), {"key": _PG_PRICE_LISTS_LOCK})
    elif connection.dialect.name == "sqlite" and not connection.connection.driver_connection.in_transaction:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


class PeriodState(NamedTuple):
    spread_frozen: bool
    closed: bool


def lock_periods(session: Session, periods: Iterable[str], *, exclusive: bool = False) -> dict[str, PeriodState]:
    """Create the billing_periods rows of `periods` where missing, lock them, and return their states.

    Shared locks for writers, an exclusive one for a closer; rows are locked in period order.
    """
    wanted = sorted(set(periods))
    if not wanted:
        return {}
    insert = dialect_insert(session.get_bind().dialect.name)
    session.execute(insert(BillingPeriod).on_conflict_do_nothing(index_elements=[BillingPeriod.period]), [{"period": p} for p in wanted])
    statement = (
        select(BillingPeriod.period, BillingPeriod.spread_frozen_at, BillingPeriod.closed_at)
        .where(BillingPeriod.period.in_(wanted))
        .order_by(BillingPeriod.period)
        .with_for_update(read=not exclusive)
    )
    return {p: PeriodState(frozen is not None, closed is not None) for p, frozen, closed in session.execute(statement)}


def file_usage(session: Session, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """For each (tenant_id, period) of a batch, the period whose invoice bills it (locked until commit)."""
    candidate = {key: key[1] for key in keys}
    filed: dict[tuple[str, str], str] = {}
    states: dict[str, PeriodState] = {}
    while candidate:
        states |= lock_periods(session, set(candidate.values()) - states.keys())
        pairs = {(tenant, period) for (tenant, _), period in candidate.items()}
        statement = select(ClosedInvoice.tenant_id, ClosedInvoice.period).where(
            tuple_(ClosedInvoice.tenant_id, ClosedInvoice.period).in_(sorted(pairs))
        )
        closed = {(tenant, period) for tenant, period in session.execute(statement)}
        for key, period in list(candidate.items()):
            if states[period].closed or (key[0], period) in closed:
                candidate[key] = next_period(period)
            else:
                filed[key] = period
                del candidate[key]
    return filed


def file_loads(session: Session, periods: Iterable[str]) -> dict[str, str]:
    """For each period of a batch of adapter loads, the period whose cold-start spread takes them."""
    candidate = {period: period for period in periods}
    filed: dict[str, str] = {}
    states: dict[str, PeriodState] = {}
    while candidate:
        states |= lock_periods(session, set(candidate.values()) - states.keys())
        for own, period in list(candidate.items()):
            if states[period].spread_frozen:
                candidate[own] = next_period(period)
            else:
                filed[own] = period
                del candidate[own]
    return filed
