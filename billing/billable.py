"""What can be billed: a tenant the registry or the ledger knows, and a month that can hold usage.

Invoices, closes and reports refuse anything else with a message naming the tenant or the period,
instead of answering (or, for a close, storing) an empty invoice that looks like a real one:

- A tenant is known when the registry holds it, or the ledger holds a usage row or a closed invoice of
  it (a tenant removed from the registry is still billed for what it used). A registered tenant that
  used nothing in a month gets an empty invoice; an id nobody knows (a typo) is UnknownTenantError.
- A period is billable when it is a YYYY-MM month of the years FIRST_YEAR..LAST_YEAR (year 0000 is no
  instant at all, and 9999-12 has no end to close at), and it has begun -- or, begun or not, the ledger
  already holds usage, busy time or adapter loads filed to it (a worker whose clock runs ahead is billed
  for what it recorded). A month that has not begun and holds nothing (2062-10 for 2026-10) is
  UnbillablePeriodError. Closing additionally needs the month to have ended (billing/closing.py).
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import exists, or_, select
from sqlalchemy.orm import Session

from billing.errors import UnbillablePeriodError, UnknownTenantError
from billing.models import AdapterLoad, Busy, ClosedInvoice, Tenant, Usage
from billing.periods import check_period, period_start

FIRST_YEAR = 1970
LAST_YEAR = 9998


def check_period_range(period: str) -> str:
    """`period` when it is well-formed and within FIRST_YEAR..LAST_YEAR, else the typed error naming it."""
    year = int(check_period(period)[:4])
    if not FIRST_YEAR <= year <= LAST_YEAR:
        raise UnbillablePeriodError(
            f"period {period} cannot be billed: the ledger bills the months {FIRST_YEAR}-01 to {LAST_YEAR}-12; check the year"
        )
    return period


def check_billable_period(session: Session, period: str, now: datetime | None = None) -> str:
    """`period` when it can be billed now (module docstring), else InvalidPeriodError / UnbillablePeriodError naming it."""
    check_period_range(period)
    now = now or datetime.now(timezone.utc)
    assert now.utcoffset() is not None, f"naive datetime {now!r}: pass an aware one"
    start = period_start(period)
    if now >= start:
        return period
    filed = session.scalar(select(or_(
        exists().where(or_(Usage.invoice_period == period, Usage.period == period)),
        exists().where(Busy.period == period),
        exists().where(or_(AdapterLoad.invoice_period == period, AdapterLoad.period == period)),
    )))
    if not filed:
        raise UnbillablePeriodError(
            f"period {period} cannot be billed: it has not begun (it starts {start:%Y-%m-%dT%H:%MZ}, it is "
            f"{now.astimezone(timezone.utc):%Y-%m-%dT%H:%MZ}) and the ledger holds nothing filed to it; check the year and month"
        )
    return period


def check_known_tenant(session: Session, tenant_id: str) -> str:
    """`tenant_id` when the registry or the ledger knows it, else UnknownTenantError naming it."""
    assert isinstance(tenant_id, str), tenant_id
    known = tenant_id != "" and session.scalar(select(or_(
        exists().where(Tenant.id == tenant_id),
        exists().where(Usage.tenant_id == tenant_id),
        exists().where(ClosedInvoice.tenant_id == tenant_id),
    )))
    if not known:
        raise UnknownTenantError(
            f"tenant {tenant_id!r} is unknown: the registry has no such tenant and the ledger holds no usage of it; "
            f"check the id (`lorabatch tenants list`), or register it first with `lorabatch tenants add`"
        )
    return tenant_id
