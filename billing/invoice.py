"""Per-tenant invoices for one billing period: drafts computed from live usage, closed ones read as frozen.

A line per (adapter, adjustment, GPU price) the tenant was billed for (base-model requests under
"base"), each carrying its GPU time by component (README.md, "Billing") and what it earned:

    gpu_ms = base_ms + lora_ms + routing_ms - kv_saved_ms + cold_start_ms,   cost = gpu_ms * price / 3_600_000
    revenue = succeeded input tokens * input price / 1e6 + output tokens * output price / 1e6

lora_ms is the LoRA compute (the requests' token shares of their steps' LoRA time) and routing_ms the
routing decisions alone, as in a result's `cost` and the SRE report. Failed requests cost GPU time but earn
nothing. Sums are in integer microseconds and tokens until each line is priced (billing/tally.py).

Lifecycle: an invoice is a "draft" while its period is open; closing (billing/closing.py) freezes it,
and from then on it is read from the stored lines, never recomputed. Usage that arrives for it later
is billed on the tenant's next open period, as lines marked "adjustment for" its own month.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from decimal import Decimal

from sqlalchemy import Engine, select, text
from sqlalchemy.orm import Session

from billing.billable import check_billable_period, check_known_tenant
from billing.config import LedgerConfig
from billing.db import read_snapshot
from billing.cost import ZERO_COST, gpu_cost, us_to_ms
from billing.models import BillingPeriod, ClosedInvoice, ClosedInvoiceLine
from billing.periods import check_period
from billing.prices import PriceBook
from billing.tally import (BASE_MODEL, LineKey, Tally, add_cold_start, billed_tiers, frozen_spread, live_spread, tenant_tiers,
                           usage_tallies)

__all__ = ["BASE_MODEL", "Invoice", "InvoiceAmounts", "InvoiceLine", "build_invoice", "period_invoices"]


@dataclass(frozen=True)
class InvoiceAmounts:
    """What a line bills, and what the totals sum: counts, GPU milliseconds (3 places) and money."""

    requests: int
    failed: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    base_ms: Decimal
    lora_ms: Decimal
    routing_ms: Decimal
    kv_saved_ms: Decimal
    cold_start_ms: Decimal
    gpu_ms: Decimal
    cost: Decimal
    revenue: Decimal


@dataclass(frozen=True)
class InvoiceLine(InvoiceAmounts):
    adapter: str = field(kw_only=True)  # "name@version", or BASE_MODEL
    adjustment_for: str | None = field(kw_only=True, default=None)  # own month of late usage billed here
    gpu_price_per_hour: Decimal = field(kw_only=True)

    @property
    def label(self) -> str:
        """The line as a reader sees it: `x@1`, or `x@1 (adjustment for 2026-10)`."""
        return self.adapter if self.adjustment_for is None else f"{self.adapter} (adjustment for {self.adjustment_for})"


@dataclass(frozen=True)
class Invoice:
    tenant: str
    period: str  # "YYYY-MM", a UTC month
    status: str  # "draft" until closing freezes it, then "closed"
    currency: str
    tier: str | None  # the tenant's tier now (at close, once closed); None when the registry does not hold the tenant
    lines: tuple[InvoiceLine, ...]
    totals: InvoiceAmounts  # each field the sum of the lines' (cost and revenue: of the rounded line amounts)
    unpriced_requests: int = 0  # succeeded requests that earned nothing: their tier had no token price
    closed_at: datetime | None = None
    # The tiers its requests' tokens were priced at, sorted: each request's tier when it ran (rows from before revision
    # 0010 at `tier`). More than one when the tenant changed tier within the period.
    tiers_billed: tuple[str, ...] = ()

    @property
    def gpu_us(self) -> int:
        return int(self.totals.gpu_ms * 1000)


def _amounts(t: Tally, cost: Decimal) -> dict[str, object]:
    return {
        "requests": t.requests, "failed": t.failed, "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
        "cached_tokens": t.cached_tokens, "base_ms": us_to_ms(t.base_us), "lora_ms": us_to_ms(t.lora_us),
        "routing_ms": us_to_ms(t.routing_us),
        "kv_saved_ms": us_to_ms(t.kv_saved_us), "cold_start_ms": us_to_ms(t.cold_start_us), "gpu_ms": us_to_ms(t.gpu_us),
        "cost": cost, "revenue": t.revenue,
    }


def _line_order(key: LineKey) -> tuple[object, ...]:
    return (key.adjustment_for is not None, key.adjustment_for or "", key.adapter != BASE_MODEL, key.adapter, key.gpu_price_per_hour)


def assemble(tenant: str, period: str, tier: str | None, currency: str, tallies: Mapping[LineKey, Tally],
             tiers_billed: tuple[str, ...] = ()) -> Invoice:
    """A draft invoice from its lines' sums: each line priced once, totals the sums of the lines."""
    lines: list[InvoiceLine] = []
    total = Tally()
    total_cost = ZERO_COST
    for key in sorted(tallies, key=_line_order):
        tally = tallies[key]
        cost = gpu_cost(tally.gpu_us, key.gpu_price_per_hour)
        lines.append(InvoiceLine(adapter=key.adapter, adjustment_for=key.adjustment_for, gpu_price_per_hour=key.gpu_price_per_hour,
                                 **_amounts(tally, cost)))
        total.add(tally)
        total_cost += cost
    return Invoice(tenant=tenant, period=period, status="draft", currency=currency, tier=tier, lines=tuple(lines),
                   totals=InvoiceAmounts(**_amounts(total, total_cost)), unpriced_requests=total.unpriced_requests,
                   tiers_billed=tiers_billed)


# Memory PostgreSQL may give each sort or hash of an invoice's aggregates. Its planner estimates the
# groups of (adapter, content, tenant) as the product of their distinct counts (80,000 for 1,400 real
# groups in the 1,000,000-row ledger bench), so with the default 4 MB it sorts ~600,000 rows through
# disk instead of hashing them: the draft of the bench's largest tenant took 2.3 s, and 0.8 s with this.
AGGREGATE_WORK_MEM = "64MB"


def tune_aggregates(session: Session) -> None:
    """Give this transaction's aggregates AGGREGATE_WORK_MEM on PostgreSQL (SET LOCAL: it ends with the transaction)."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text(f"SET LOCAL work_mem = '{AGGREGATE_WORK_MEM}'"))


def _snapshot(db: Session | Engine) -> Session:
    """`db` itself when a Session, else a session over it that reads one snapshot (billing.db.read_snapshot)."""
    if isinstance(db, Session):
        return db
    session = read_snapshot(db)
    tune_aggregates(session)
    return session


def build_invoice(db: Session | Engine, tenant_id: str, period: str, config: LedgerConfig, *, now: datetime | None = None) -> Invoice:
    """The invoice of `tenant_id` for `period` ("YYYY-MM", UTC): the frozen one once closed, else the draft.

    Given an Engine, it is read in one snapshot; given a Session, in that session's transaction. The
    draft prices each row's GPU time with the price list of the GPU kind it records (config.gpu_price_per_hour
    where none applies to config.gpu_kind, and to rows that record no kind; UnpricedGpuKindError for another
    kind with no price) and its tokens with the list of the tier it records (the tenant's when it ran; rows
    from before revision 0010 at the tenant's tier now). A period that cannot be billed, or a tenant nobody
    knows, is refused (billing/billable.py), `now` deciding whether the period has begun.
    """
    check_period(period)
    session = _snapshot(db)
    try:
        check_billable_period(session, period, now)
        check_known_tenant(session, tenant_id)
        closed = read_closed(session, period, tenant_id)
        if tenant_id in closed:
            return closed[tenant_id]
        period_closed_at = session.scalar(select(BillingPeriod.closed_at).where(BillingPeriod.period == period))
        if period_closed_at is not None:
            # Closed with the period but never billed anything: an empty closed invoice, closed with the month.
            # In the month's currency, fixed by its first close (billing/closing.py), not today's ledger.currency: it said EUR
            # for a month closed in USD. A month closed with no invoice at all has none but today's.
            tier = tenant_tiers(session, {tenant_id})[tenant_id]
            currency = session.scalar(select(ClosedInvoice.currency).where(ClosedInvoice.period == period).limit(1)) or config.currency
            return replace(assemble(tenant_id, period, tier, currency, {}), status="closed", closed_at=period_closed_at)
        return draft_invoices(session, period, config, tenant_id)[tenant_id]
    finally:
        if session is not db:
            session.close()


def draft_invoices(session: Session, period: str, config: LedgerConfig, tenant_id: str | None = None) -> dict[str, Invoice]:
    """Draft invoices computed from the ledger now: of one tenant (always returned), or of every tenant billed in `period`."""
    prices = PriceBook.load(session, config.gpu_kind, config.gpu_price_per_hour, config.currency)
    tallies = usage_tallies(session, period, prices, tenant_id)
    frozen = session.scalar(select(BillingPeriod.spread_frozen_at).where(BillingPeriod.period == period)) is not None
    if frozen:
        shares = frozen_spread(session, period, tenant_id)
    elif tenant_id is not None:
        used = sorted({key.adapter for key in tallies.get(tenant_id, {}) if key.adapter != BASE_MODEL})
        shares = [s for s in live_spread(session, period, prices, used) if s.tenant_id == tenant_id]
    else:
        shares = live_spread(session, period, prices)
    add_cold_start(tallies, shares)
    if tenant_id is not None:
        tallies.setdefault(tenant_id, {})
    tiers = tenant_tiers(session, set(tallies))
    billed = billed_tiers(session, period, tiers, tenant_id)
    return {tenant: assemble(tenant, period, tiers[tenant], config.currency, lines, billed.get(tenant, ()))
            for tenant, lines in tallies.items()}


_LINE_INTS = ("requests", "failed", "input_tokens", "output_tokens", "cached_tokens")


def _stored_amounts(row: ClosedInvoice | ClosedInvoiceLine) -> dict[str, object]:
    tally = Tally(**{name: getattr(row, name) for name in (*_LINE_INTS, "base_us", "lora_us", "routing_us", "kv_saved_us", "cold_start_us")}, revenue=row.revenue)
    return _amounts(tally, row.cost)


def read_closed(session: Session, period: str, tenant_id: str | None = None) -> dict[str, Invoice]:
    """The closed invoices of `period` (of one tenant, or all), exactly as they were frozen."""
    statement = select(ClosedInvoice).where(ClosedInvoice.period == period).order_by(ClosedInvoice.tenant_id)
    if tenant_id is not None:
        statement = statement.where(ClosedInvoice.tenant_id == tenant_id)
    invoices = list(session.scalars(statement))
    if not invoices:
        return {}
    lines = session.scalars(
        select(ClosedInvoiceLine).where(ClosedInvoiceLine.invoice_id.in_([i.id for i in invoices])).order_by(ClosedInvoiceLine.invoice_id, ClosedInvoiceLine.position)
    )
    by_invoice: dict[int, list[InvoiceLine]] = {i.id: [] for i in invoices}
    for line in lines:
        by_invoice[line.invoice_id].append(
            InvoiceLine(adapter=line.adapter, adjustment_for=line.adjustment_for, gpu_price_per_hour=line.gpu_price_per_hour, **_stored_amounts(line))
        )
    # The rows billed on a closed invoice never change (later ones go to an open period): their tiers, untiered rows at
    # the tier frozen at close, are those the invoice priced.
    billed = billed_tiers(session, period, {i.tenant_id: i.tier for i in invoices}, tenant_id)
    return {
        i.tenant_id: Invoice(
            tenant=i.tenant_id, period=i.period, status="closed", currency=i.currency, tier=i.tier, lines=tuple(by_invoice[i.id]),
            totals=InvoiceAmounts(**_stored_amounts(i)), unpriced_requests=i.unpriced_requests, closed_at=i.closed_at,
            tiers_billed=billed.get(i.tenant_id, ()),
        )
        for i in invoices
    }


def period_invoices(db: Session | Engine, period: str, config: LedgerConfig, *, now: datetime | None = None) -> list[Invoice]:
    """Every invoice of `period`, by tenant: the closed ones as frozen, the others as drafts now (a period that cannot be billed is refused)."""
    check_period(period)
    session = _snapshot(db)
    try:
        check_billable_period(session, period, now)
        invoices = read_closed(session, period)
        period_closed = session.scalar(select(BillingPeriod.closed_at).where(BillingPeriod.period == period)) is not None
        if not period_closed:
            for tenant, draft in draft_invoices(session, period, config).items():
                invoices.setdefault(tenant, draft)
        return [invoices[tenant] for tenant in sorted(invoices)]
    finally:
        if session is not db:
            session.close()
