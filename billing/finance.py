"""The finance report of a period: per tenant, revenue, GPU cost, margin, and GPU share against revenue share.

Built from the period's invoices (the frozen ones once closed, drafts before), so it always agrees
with what the tenants are billed. A tenant is flagged when its share of the period's GPU time exceeds
its share of the revenue by more than the flag factor (LedgerConfig.finance_flag_factor, 1.5 unless
set): gpu_us / total_gpu_us > factor * revenue / total_revenue, compared exactly in integers and
Decimals. With no revenue at all in the period every tenant that used the GPU is flagged.

The report's currency is its invoices' (a closed invoice keeps the one it was closed in; drafts take
LedgerConfig.currency). Invoices of two currencies are never added up: MixedCurrencyError names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from decimal import ROUND_HALF_EVEN, Decimal

from sqlalchemy import Engine
from sqlalchemy.orm import Session

from billing.config import LedgerConfig
from billing.cost import ZERO_COST
from billing.errors import MixedCurrencyError
from billing.invoice import Invoice, period_invoices

_SHARE_QUANTUM = Decimal("0.0001")  # shares to a hundredth of a percent


@dataclass(frozen=True)
class TenantFinance:
    tenant: str
    tier: str | None
    status: str  # of its invoice: "draft" or "closed"
    requests: int
    gpu_ms: Decimal
    cost: Decimal
    revenue: Decimal
    margin: Decimal  # revenue - cost
    gpu_share: Decimal  # of the period's GPU time, 0..1, four places
    revenue_share: Decimal  # of the period's revenue, 0..1, four places
    flagged: bool
    unpriced_requests: int


@dataclass(frozen=True)
class FinanceReport:
    period: str
    currency: str
    flag_factor: Decimal
    tenants: tuple[TenantFinance, ...]
    requests: int
    gpu_ms: Decimal
    cost: Decimal
    revenue: Decimal
    margin: Decimal


def _share(part: Decimal, whole: Decimal) -> Decimal:
    return (part / whole).quantize(_SHARE_QUANTUM, rounding=ROUND_HALF_EVEN) if whole else Decimal(0).quantize(_SHARE_QUANTUM)


def _one_currency(period: str, invoices: list[Invoice], default: str) -> str:
    """The one currency of `invoices` (`default` when there are none), else MixedCurrencyError naming each currency's tenants."""
    tenants: dict[str, list[str]] = {}
    for invoice in invoices:
        tenants.setdefault(invoice.currency, []).append(f"{invoice.tenant} ({invoice.status})")
    if len(tenants) > 1:
        listed = "; ".join(f"{currency}: {', '.join(names)}" for currency, names in sorted(tenants.items()))
        raise MixedCurrencyError(
            f"period {period}'s invoices are in {len(tenants)} currencies ({listed}), and a report cannot add them up; "
            f"closed invoices keep the currency they were closed in, drafts take ledger.currency ({default}): set ledger.currency "
            f"to the closed invoices' currency"
        )
    return next(iter(tenants), default)


def finance_report(db: Engine | Session, period: str, config: LedgerConfig, flag_factor: Decimal | None = None, *,
                   now: datetime | None = None) -> FinanceReport:
    """The finance report of `period`; `flag_factor` overrides config.finance_flag_factor (a period that cannot be billed is refused)."""
    factor = config.finance_flag_factor if flag_factor is None else flag_factor
    assert isinstance(factor, Decimal) and factor > 0, f"flag_factor must be a positive Decimal, got {factor!r}"
    invoices: list[Invoice] = period_invoices(db, period, config, now=now)
    currency = _one_currency(period, invoices, config.currency)
    gpu_total = sum((i.totals.gpu_ms for i in invoices), Decimal("0.000"))  # three places even with no invoice
    revenue_total = sum((i.totals.revenue for i in invoices), ZERO_COST)
    tenants = []
    for invoice in invoices:
        t = invoice.totals
        if revenue_total > 0:
            flagged = t.gpu_ms * revenue_total > factor * t.revenue * gpu_total
        else:
            flagged = t.gpu_ms > 0
        tenants.append(
            TenantFinance(
                tenant=invoice.tenant, tier=invoice.tier, status=invoice.status, requests=t.requests, gpu_ms=t.gpu_ms, cost=t.cost,
                revenue=t.revenue, margin=t.revenue - t.cost, gpu_share=_share(t.gpu_ms, gpu_total),
                revenue_share=_share(t.revenue, revenue_total), flagged=flagged, unpriced_requests=invoice.unpriced_requests,
            )
        )
    cost_total = sum((t.cost for t in tenants), ZERO_COST)
    return FinanceReport(
        period=period, currency=currency, flag_factor=factor, tenants=tuple(tenants), requests=sum(t.requests for t in tenants),
        gpu_ms=gpu_total, cost=cost_total, revenue=revenue_total, margin=revenue_total - cost_total,
    )
