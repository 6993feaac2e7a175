"""Closing invoices: freeze a tenant's invoice of a period, or every tenant's, so that it never changes again.

At the first close touching a period its cold-start spread is computed over all the period's usage as
it stands, across tenants, and stored (cold_start_shares); every invoice of the period, closed then or
later, takes its cold-start lines from that stored spread, so the shares of an adapter's load time add
up to that time exactly whatever order the invoices close in. A closed invoice's lines and totals are
stored as computed; reading it later reads those rows. Usage that arrives for it afterwards is billed
on the tenant's next open period (billing/filing.py).

A period closes only once it has ended (its last UTC instant has passed): before that its usage is
still arriving. Closing what is already closed changes nothing and returns the frozen invoice. A period's
first close fixes its currency: the rest of its invoices close in the currency of those already closed, or
not at all (MixedCurrencyError), so that the month's finance report can always add them up.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import Engine, select, update
from sqlalchemy.orm import Session

from billing.billable import check_known_tenant, check_period_range
from billing.config import LedgerConfig
from billing.db import session_factory
from billing.errors import MixedCurrencyError, PeriodNotEndedError
from billing.filing import lock_periods, lock_price_lists
from billing.invoice import Invoice, build_invoice, draft_invoices, read_closed, tune_aggregates
from billing.models import BillingPeriod, ClosedInvoice, ClosedInvoiceLine, ColdStartShare
from billing.periods import period_end
from billing.prices import PriceBook
from billing.tally import live_spread


def _check_ended(period: str, now: datetime | None) -> datetime:
    now = now or datetime.now(timezone.utc)
    assert now.utcoffset() is not None, f"naive datetime {now!r}: pass an aware one"
    end = period_end(check_period_range(period))
    if now < end:
        raise PeriodNotEndedError(
            f"period {period} runs until {end:%Y-%m-%dT%H:%MZ} and it is {now.astimezone(timezone.utc):%Y-%m-%dT%H:%MZ}; "
            f"close it after it has ended, when its usage has arrived (the draft is always readable with `lorabatch invoice`)"
        )
    return now


def close_invoice(engine: Engine, config: LedgerConfig, tenant_id: str, period: str, *, now: datetime | None = None) -> Invoice:
    """Close `tenant_id`'s invoice of `period` and return it as frozen (at once, if it already was)."""
    closed_at = _check_ended(period, now)
    with session_factory(engine).begin() as session:
        lock_price_lists(session, exclusive=False)  # a price being set commits before this close reads the prices
        check_known_tenant(session, tenant_id)  # before anything is locked or stored: an unknown id gets no closed invoice
        state = lock_periods(session, [period], exclusive=True)[period]
        tune_aggregates(session)
        if state.closed or read_closed(session, period, tenant_id):
            return build_invoice(session, tenant_id, period, config)
        _check_currency(session, period, config)
        _freeze_spread(session, period, config, closed_at, state.spread_frozen)
        _store(session, draft_invoices(session, period, config, tenant_id)[tenant_id], closed_at)
        return read_closed(session, period, tenant_id)[tenant_id]


def close_period(engine: Engine, config: LedgerConfig, period: str, *, now: datetime | None = None) -> list[Invoice]:
    """Close every tenant's invoice of `period` and the period itself; return the period's invoices, by tenant."""
    closed_at = _check_ended(period, now)
    with session_factory(engine).begin() as session:
        lock_price_lists(session, exclusive=False)
        state = lock_periods(session, [period], exclusive=True)[period]
        tune_aggregates(session)
        if not state.closed:
            _freeze_spread(session, period, config, closed_at, state.spread_frozen)
            done = read_closed(session, period)
            drafts = {tenant: draft for tenant, draft in draft_invoices(session, period, config).items() if tenant not in done}
            if drafts:
                _check_currency(session, period, config)
            for draft in drafts.values():
                _store(session, draft, closed_at)
            session.execute(update(BillingPeriod).where(BillingPeriod.period == period).values(closed_at=closed_at))
        invoices = read_closed(session, period)
        return [invoices[tenant] for tenant in sorted(invoices)]


def _check_currency(session: Session, period: str, config: LedgerConfig) -> None:
    """MixedCurrencyError when invoices of `period` were closed in a currency other than config.currency: closing the
    rest would leave the month in two currencies for good (measured: acme closed in USD, then `--close-period` under
    EUR froze globex in EUR, and the month's finance report was refused whatever ledger.currency said)."""
    closed_in = sorted(set(session.scalars(select(ClosedInvoice.currency).where(ClosedInvoice.period == period))) - {config.currency})
    if closed_in:
        raise MixedCurrencyError(
            f"period {period} has invoices closed in {', '.join(closed_in)} and ledger.currency is {config.currency}: closing "
            f"the rest in {config.currency} would leave the month in two currencies, which no report can add up; close it "
            f"with ledger.currency = \"{closed_in[0]}\"")


def _freeze_spread(session: Session, period: str, config: LedgerConfig, at: datetime, frozen: bool) -> None:
    if frozen:
        return
    prices = PriceBook.load(session, config.gpu_kind, config.gpu_price_per_hour, config.currency, tokens=False)
    shares = live_spread(session, period, prices)
    if shares:
        session.execute(
            ColdStartShare.__table__.insert(),
            [{"period": period, **share._asdict()} for share in shares],
        )
    session.execute(update(BillingPeriod).where(BillingPeriod.period == period).values(spread_frozen_at=at))


def _us(ms: object) -> int:
    return int(ms * 1000)  # type: ignore[operator]  # ms carry exactly three places: exact


def _store(session: Session, invoice: Invoice, closed_at: datetime) -> None:
    t = invoice.totals
    row = ClosedInvoice(
        tenant_id=invoice.tenant, period=invoice.period, tier=invoice.tier, currency=invoice.currency, closed_at=closed_at,
        requests=t.requests, failed=t.failed, input_tokens=t.input_tokens, output_tokens=t.output_tokens, cached_tokens=t.cached_tokens,
        base_us=_us(t.base_ms), lora_us=_us(t.lora_ms), routing_us=_us(t.routing_ms), kv_saved_us=_us(t.kv_saved_ms), cold_start_us=_us(t.cold_start_ms),
        unpriced_requests=invoice.unpriced_requests, cost=t.cost, revenue=t.revenue,
    )
    session.add(row)
    session.flush()
    session.add_all(
        ClosedInvoiceLine(
            invoice_id=row.id, position=i, adapter=line.adapter, adjustment_for=line.adjustment_for, gpu_price_per_hour=line.gpu_price_per_hour,
            requests=line.requests, failed=line.failed, input_tokens=line.input_tokens, output_tokens=line.output_tokens,
            cached_tokens=line.cached_tokens, base_us=_us(line.base_ms), lora_us=_us(line.lora_ms), routing_us=_us(line.routing_ms),
            kv_saved_us=_us(line.kv_saved_ms), cold_start_us=_us(line.cold_start_ms), cost=line.cost, revenue=line.revenue,
        )
        for i, line in enumerate(invoice.lines)
    )
    session.flush()
