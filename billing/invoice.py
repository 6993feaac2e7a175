"""Per-tenant invoices for one billing period, and their table, JSON and CSV renderings.

A line per adapter the tenant used (base-model requests under "base"), each carrying the four cost
components of DESIGN.md's cost attribution:

    gpu_ms = base_ms + routing_ms - kv_saved_ms + cold_start_ms,   cost = gpu_ms * price / 3_600_000

routing_ms is the routing decision plus the LoRA compute. Cold start: an adapter's load time in the
period is spread over all its requests of the period, of every tenant that used it (public adapters are
shared), in proportion to their tokens, in whole microseconds that add up to the measured load time
exactly. It is computed when the invoice is built, so the invoice is a "draft".
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from dataclasses import dataclass, field, fields
from decimal import Decimal

from sqlalchemy import Engine, case, func, select
from sqlalchemy.orm import Session

from billing.apportion import apportion
from billing.config import LedgerConfig
from billing.cost import ZERO_COST, gpu_cost, us_to_ms
from billing.models import AdapterLoad, Usage
from billing.periods import check_period

BASE_MODEL = "base"  # the line of requests served by the base model alone
_DEFAULT_CURRENCY: str = LedgerConfig.model_fields["currency"].default


@dataclass(frozen=True)
class InvoiceAmounts:
    """What a line bills, and what the totals sum: counts, GPU milliseconds (3 places) and money."""

    requests: int
    failed: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    base_ms: Decimal
    routing_ms: Decimal
    kv_saved_ms: Decimal
    cold_start_ms: Decimal
    gpu_ms: Decimal
    cost: Decimal


@dataclass(frozen=True)
class InvoiceLine(InvoiceAmounts):
    adapter: str = field(kw_only=True)  # "name@version", or BASE_MODEL


@dataclass(frozen=True)
class Invoice:
    tenant: str
    period: str  # "YYYY-MM", a UTC month
    status: str  # "draft" until period close freezes it
    currency: str
    price_per_hour: Decimal
    lines: tuple[InvoiceLine, ...]
    totals: InvoiceAmounts  # each field the sum of the lines' (cost: of the rounded line costs)


@dataclass
class _Tally:
    """A line's sums in integer microseconds, so that nothing is rounded before the end."""

    requests: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    base_us: int = 0
    routing_us: int = 0
    kv_saved_us: int = 0
    cold_start_us: int = 0

    def add(self, other: _Tally) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def gpu_us(self) -> int:
        return self.base_us + self.routing_us - self.kv_saved_us + self.cold_start_us

    def amounts(self, cost: Decimal) -> dict[str, object]:
        return {
            "requests": self.requests,
            "failed": self.failed,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cached_tokens": self.cached_tokens,
            "base_ms": us_to_ms(self.base_us),
            "routing_ms": us_to_ms(self.routing_us),
            "kv_saved_ms": us_to_ms(self.kv_saved_us),
            "cold_start_ms": us_to_ms(self.cold_start_us),
            "gpu_ms": us_to_ms(self.gpu_us),
            "cost": cost,
        }


def build_invoice(
    session_or_engine: Session | Engine,
    tenant_id: str,
    period: str,
    price_per_hour: Decimal,
    *,
    currency: str = _DEFAULT_CURRENCY,
) -> Invoice:
    """The draft invoice of `tenant_id` for `period` ("YYYY-MM", UTC) at `price_per_hour`.

    Given an Engine, the invoice is read in one snapshot (REPEATABLE READ on PostgreSQL); given a
    Session, it is read in that session's transaction.
    """
    check_period(period)
    assert tenant_id, "tenant_id must name a tenant"
    assert isinstance(price_per_hour, Decimal), f"price_per_hour must be a Decimal, got {price_per_hour!r}"
    if isinstance(session_or_engine, Session):
        return _build(session_or_engine, tenant_id, period, price_per_hour, currency)
    engine = session_or_engine
    if engine.dialect.name == "postgresql":
        engine = engine.execution_options(isolation_level="REPEATABLE READ")
    with Session(engine) as session:
        return _build(session, tenant_id, period, price_per_hour, currency)


def _build(session: Session, tenant_id: str, period: str, price_per_hour: Decimal, currency: str) -> Invoice:
    tallies = _tenant_tallies(session, tenant_id, period)
    cold = _cold_start_us(session, tenant_id, period, [a for a in tallies if a != BASE_MODEL])
    lines: list[InvoiceLine] = []
    total = _Tally()
    total_cost = ZERO_COST
    for adapter in sorted(tallies, key=lambda a: (a != BASE_MODEL, a)):
        tally = tallies[adapter]
        tally.cold_start_us = cold.get(adapter, 0)
        cost = gpu_cost(tally.gpu_us, price_per_hour)
        lines.append(InvoiceLine(adapter=adapter, **tally.amounts(cost)))
        total.add(tally)
        total_cost += cost
    return Invoice(
        tenant=tenant_id,
        period=period,
        status="draft",
        currency=currency,
        price_per_hour=price_per_hour,
        lines=tuple(lines),
        totals=InvoiceAmounts(**total.amounts(total_cost)),
    )


def _tenant_tallies(session: Session, tenant_id: str, period: str) -> dict[str, _Tally]:
    statement = (
        select(
            Usage.adapter,
            func.count().label("requests"),
            func.sum(case((Usage.status == "failed", 1), else_=0)).label("failed"),
            func.sum(Usage.input_tokens).label("input_tokens"),
            func.sum(Usage.output_tokens).label("output_tokens"),
            func.sum(Usage.cached_tokens).label("cached_tokens"),
            func.sum(Usage.base_us).label("base_us"),
            func.sum(Usage.routing_us + Usage.lora_us).label("routing_us"),
            func.sum(Usage.kv_saved_us).label("kv_saved_us"),
        )
        .where(Usage.tenant_id == tenant_id, Usage.period == period)
        .group_by(Usage.adapter)
    )
    tallies = {}
    for row in session.execute(statement):
        sums = dict(row._mapping)
        adapter = sums.pop("adapter")
        # PostgreSQL's SUM(bigint) is numeric, read back as an integral Decimal: int() is exact.
        tallies[adapter or BASE_MODEL] = _Tally(**{key: int(value) for key, value in sums.items()})
    return tallies


def _cold_start_us(session: Session, tenant_id: str, period: str, adapters: list[str]) -> dict[str, int]:
    """This tenant's share, in us, of the load time of each of `adapters` in `period`.

    Loads are grouped by (adapter, content hash); a request shares in a group's load time when it used
    that name@version and, if its row records a hash, the same content. Two tenants' private adapters
    that share a name@version but not content so never pay for each other's loads.
    """
    if not adapters:
        return {}
    loads = session.execute(
        select(AdapterLoad.adapter, AdapterLoad.adapter_sha256, func.sum(AdapterLoad.load_us))
        .where(AdapterLoad.period == period, AdapterLoad.adapter.in_(adapters))
        .group_by(AdapterLoad.adapter, AdapterLoad.adapter_sha256)
    ).all()
    if not loads:
        return {}
    users = session.execute(
        select(
            Usage.adapter,
            Usage.adapter_sha256,
            Usage.tenant_id,
            func.sum(Usage.input_tokens + Usage.output_tokens),
            func.count(),
        )
        .where(Usage.period == period, Usage.adapter.in_(sorted({adapter for adapter, _, _ in loads})))
        .group_by(Usage.adapter, Usage.adapter_sha256, Usage.tenant_id)
    ).all()
    shares: dict[str, int] = defaultdict(int)
    for adapter, sha256, load_us in loads:
        tokens: dict[str, int] = defaultdict(int)
        requests: dict[str, int] = defaultdict(int)
        for used, used_sha256, tenant, n_tokens, n_requests in users:
            if used == adapter and used_sha256 in (None, sha256):
                tokens[tenant] += int(n_tokens)
                requests[tenant] += n_requests
        if not requests:
            continue  # loaded but never used in the period: no request to carry it
        # Requests that produced no token at all (e.g. all failed early) share the load time equally.
        weights = tokens if sum(tokens.values()) > 0 else requests
        shares[adapter] += apportion(int(load_us), weights).get(tenant_id, 0)
    return shares


# ---- renderings -------------------------------------------------------------------------------------

_AMOUNT_KEYS = tuple(f.name for f in fields(InvoiceAmounts))


def _decimal_text(value: Decimal) -> str:
    """Fixed-point text of a Decimal ("0.000000000", never "0E-9" or "-0.000")."""
    return format(value if value else abs(value), "f")


def _amounts(amounts: InvoiceAmounts) -> dict[str, int | str]:
    values = {key: getattr(amounts, key) for key in _AMOUNT_KEYS}
    return {key: _decimal_text(v) if isinstance(v, Decimal) else v for key, v in values.items()}


def render_json(invoice: Invoice) -> str:
    """The invoice as JSON: tenant, period, status, currency, lines and totals; decimals as strings."""
    document = {
        "tenant": invoice.tenant,
        "period": invoice.period,
        "status": invoice.status,
        "currency": invoice.currency,
        "lines": [{"adapter": line.adapter, **_amounts(line)} for line in invoice.lines],
        "totals": _amounts(invoice.totals),
    }
    return json.dumps(document, indent=2)


def render_csv(invoice: Invoice) -> str:
    """One row per line and a final TOTAL row, each with the tenant, period and currency (RFC 4180)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(("tenant", "period", "status", "currency", "adapter", *_AMOUNT_KEYS))
    head = (invoice.tenant, invoice.period, invoice.status, invoice.currency)
    for line in invoice.lines:
        writer.writerow((*head, line.adapter, *_amounts(line).values()))
    writer.writerow((*head, "TOTAL", *_amounts(invoice.totals).values()))
    return out.getvalue()


def render_table(invoice: Invoice) -> str:
    """The invoice as an aligned text table: adapters left-aligned, numbers right-aligned, totals last."""
    header = ("adapter", *_AMOUNT_KEYS)
    body = [(line.adapter, *map(str, _amounts(line).values())) for line in invoice.lines]
    total = ("total", *map(str, _amounts(invoice.totals).values()))
    widths = [max(len(row[i]) for row in (header, *body, total)) for i in range(len(header))]

    def row_text(row: tuple[str, ...]) -> str:
        return "  ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))])

    rule = "  ".join("-" * w for w in widths)
    title = (
        f"Invoice {invoice.tenant} {invoice.period} ({invoice.status}), {invoice.currency} "
        f"at {_decimal_text(invoice.price_per_hour)} per GPU hour"
    )
    return "\n".join([title, row_text(header), rule, *map(row_text, body), rule, row_text(total)]) + "\n"
