"""The sums an invoice is made of: usage per line, and the cold-start spread, all in integers until the end.

A line of a tenant's invoice for period P is keyed by (adapter, adjustment_for, GPU price): the adapter
("base" for the base model), the month of late usage billed here (None for P's own usage), and the GPU
price per hour its time is charged at, so a price change within a month makes two lines, and so do two
GPU kinds of different prices. Each row's time is priced by the GPU kind it records (billing/prices.py), and its
tokens by the tier it records: its tenant's tier when it ran (rows that record none, written before revision 0010,
at the tenant's tier in the registry now). Usage is summed in SQL per (tenant, adapter, own period, price segment,
GPU kind, tier) -- one statement whatever the number of tenants -- and priced in Python: cost = gpu_cost(sum of us,
price) once per line, revenue once per (line, token price).

Cold start: each load billed to P is spread over the requests billed to P that used that adapter
name@version with the same content (or whose row records no hash), in proportion to their tokens (per
request when none has a token), in whole microseconds that add up to the load time exactly. Loads are
spread per (adapter, content, GPU price): the loads of each priced at the price in effect when they happened of the
GPU they were loaded onto, summed, and apportioned once, so no other price entry changes the split. A tenant that
carries none of a load has no share. The spread is computed live for drafts and frozen at the period's first close.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, fields
from decimal import ROUND_HALF_EVEN, Decimal, localcontext
from typing import NamedTuple

from sqlalchemy import BigInteger, case, cast, func, select
from sqlalchemy.orm import Session

from billing.apportion import apportion
from billing.cost import MONEY_PLACES, ZERO_COST
from billing.credit import kv_credit_sql
from billing.models import AdapterLoad, ColdStartShare, Tenant, Usage
from billing.prices import PriceBook, TokenPriceEntry

BASE_MODEL = "base"  # the line of requests served by the base model alone
_MONEY_QUANTUM = Decimal(1).scaleb(-MONEY_PLACES)


class LineKey(NamedTuple):
    adapter: str  # "name@version" or BASE_MODEL
    adjustment_for: str | None  # the own period of late usage billed here; None for the period's own usage
    gpu_price_per_hour: Decimal


@dataclass
class Tally:
    """One line's sums: counts and integer microseconds; revenue already rounded per token price."""

    requests: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    base_us: int = 0
    lora_us: int = 0  # the LoRA compute: the requests' token shares of their steps' LoRA time
    routing_us: int = 0  # the routing decisions alone
    kv_saved_us: int = 0  # the KV credit as billed (billing/credit.py), never more than base + LoRA of its requests
    cold_start_us: int = 0
    revenue: Decimal = ZERO_COST
    unpriced_requests: int = 0  # succeeded requests whose tier (as they ran) had no token price then

    def add(self, other: Tally) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def gpu_us(self) -> int:
        return self.base_us + self.lora_us + self.routing_us - self.kv_saved_us + self.cold_start_us


def token_revenue(input_tokens: int, output_tokens: int, price: TokenPriceEntry) -> Decimal:
    """What the tokens earn at `price`, rounded once, half to even, to nine places."""
    with localcontext() as ctx:
        ctx.prec = 60
        exact = (input_tokens * price.input_per_million + output_tokens * price.output_per_million) / 1_000_000
        return exact.quantize(_MONEY_QUANTUM, rounding=ROUND_HALF_EVEN)


def tenant_tiers(session: Session, tenant_ids: set[str]) -> dict[str, str | None]:
    """Each tenant's tier in the registry now; None for a tenant the registry does not hold."""
    if not tenant_ids:
        return {}
    found = {tenant: tier for tenant, tier in session.execute(select(Tenant.id, Tenant.tier).where(Tenant.id.in_(sorted(tenant_ids))))}
    return {tenant: found.get(tenant) for tenant in tenant_ids}


def usage_tallies(session: Session, period: str, prices: PriceBook, tenant_id: str | None = None) -> dict[str, dict[LineKey, Tally]]:
    """Per tenant (one, or every tenant billed in `period`), the usage sums of each line of its invoice."""
    segment = prices.segment_of(Usage.created_at).label("segment")
    succeeded = Usage.status == "succeeded"
    statement = (
        select(
            Usage.tenant_id,
            Usage.adapter,
            Usage.period,
            segment,
            Usage.gpu_kind,
            Usage.tier,
            func.count().label("requests"),
            func.sum(case((succeeded, 0), else_=1)).label("failed"),
            func.sum(Usage.input_tokens).label("input_tokens"),
            func.sum(Usage.output_tokens).label("output_tokens"),
            func.sum(Usage.cached_tokens).label("cached_tokens"),
            func.sum(Usage.base_us).label("base_us"),
            func.sum(Usage.lora_us).label("lora_us"),
            func.sum(Usage.routing_us).label("routing_us"),
            func.sum(kv_credit_sql()).label("kv_saved_us"),  # the credit as billed (billing/credit.py)
            func.sum(case((succeeded, Usage.input_tokens), else_=0)).label("billed_input"),
            func.sum(case((succeeded, Usage.output_tokens), else_=0)).label("billed_output"),
        )
        .where(Usage.invoice_period == period)
        .group_by(Usage.tenant_id, Usage.adapter, Usage.period, segment, Usage.gpu_kind, Usage.tier)
    )
    if tenant_id is not None:
        statement = statement.where(Usage.tenant_id == tenant_id)
    groups = session.execute(statement).all()
    # Rows from before revision 0010 record no tier: priced at the tenant's tier now, as every row was then.
    tiers = tenant_tiers(session, {g.tenant_id for g in groups if g.tier is None})
    tallies: dict[str, dict[LineKey, Tally]] = defaultdict(lambda: defaultdict(Tally))
    billed: dict[tuple[str, LineKey, TokenPriceEntry], list[int]] = defaultdict(lambda: [0, 0])
    for g in groups:
        start = prices.segment_start(int(g.segment))
        key = LineKey(g.adapter or BASE_MODEL, None if g.period == period else g.period, prices.gpu_price_at(start, g.gpu_kind))
        # PostgreSQL's SUM(bigint) is numeric, read back as an integral Decimal: int() is exact.
        tally = Tally(**{name: int(getattr(g, name)) for name in
                         ("requests", "failed", "input_tokens", "output_tokens", "cached_tokens", "base_us", "lora_us", "routing_us", "kv_saved_us")})
        token_price = prices.token_price_at(g.tier if g.tier is not None else tiers[g.tenant_id], start)
        if token_price is None:
            tally.unpriced_requests = tally.requests - tally.failed
        else:
            sums = billed[(g.tenant_id, key, token_price)]
            sums[0] += int(g.billed_input)
            sums[1] += int(g.billed_output)
        tallies[g.tenant_id][key].add(tally)
    for (tenant, key, token_price), (input_tokens, output_tokens) in billed.items():
        tallies[tenant][key].revenue += token_revenue(input_tokens, output_tokens, token_price)
    return {tenant: dict(lines) for tenant, lines in tallies.items()}


def billed_tiers(session: Session, period: str, current: dict[str, str | None], tenant_id: str | None = None) -> dict[str, tuple[str, ...]]:
    """Per tenant billed in `period` (one, or all), the tiers its requests' tokens are priced at, sorted: each row's
    own tier, or `current[tenant]` (the tier an invoice prices untiered rows at) for rows that record none."""
    statement = select(Usage.tenant_id, Usage.tier).where(Usage.invoice_period == period).group_by(Usage.tenant_id, Usage.tier)
    if tenant_id is not None:
        statement = statement.where(Usage.tenant_id == tenant_id)
    found: dict[str, set[str]] = defaultdict(set)
    for tenant, tier in session.execute(statement):
        if (tier := tier if tier is not None else current.get(tenant)) is not None:
            found[tenant].add(tier)
    return {tenant: tuple(sorted(tiers)) for tenant, tiers in found.items()}


class Share(NamedTuple):
    tenant_id: str
    adapter: str
    adapter_sha256: str
    gpu_price_per_hour: Decimal
    share_us: int


def live_spread(session: Session, period: str, prices: PriceBook, adapters: list[str] | None = None) -> list[Share]:
    """The cold-start spread of `period` as the ledger stands now (of `adapters` only, when given)."""
    segment = prices.segment_of(AdapterLoad.created_at).label("segment")
    statement = (
        select(AdapterLoad.adapter, AdapterLoad.adapter_sha256, segment, AdapterLoad.gpu_kind, func.sum(AdapterLoad.load_us))
        .where(AdapterLoad.invoice_period == period)
        .group_by(AdapterLoad.adapter, AdapterLoad.adapter_sha256, segment, AdapterLoad.gpu_kind)
        .order_by(AdapterLoad.adapter, AdapterLoad.adapter_sha256, segment, AdapterLoad.gpu_kind)
    )
    if adapters is not None:
        if not adapters:
            return []
        statement = statement.where(AdapterLoad.adapter.in_(sorted(adapters)))
    loads = session.execute(statement).all()
    if not loads:
        return []
    users = session.execute(
        select(Usage.adapter, Usage.adapter_sha256, Usage.tenant_id, func.sum(cast(Usage.input_tokens, BigInteger) + Usage.output_tokens), func.count())
        .where(Usage.invoice_period == period, Usage.adapter.in_(sorted({adapter for adapter, *_ in loads})))
        .group_by(Usage.adapter, Usage.adapter_sha256, Usage.tenant_id)
    ).all()
    # One sum per (adapter, content, GPU price), the key of a share, apportioned once: per SQL group (a segment that any
    # price entry cuts, token prices' too, and a GPU kind) each group's left-over units went by the tie rule again, so a
    # token price set between two 1 us loads billed one of two equal users 2 us in the draft, and 1 us once closed.
    priced: dict[tuple[str, str, Decimal], int] = defaultdict(int)
    for adapter, sha256, seg, kind, load_us in loads:
        priced[(adapter, sha256, prices.gpu_price_at(prices.segment_start(int(seg)), kind))] += int(load_us)
    shares: dict[tuple[str, str, str, Decimal], int] = defaultdict(int)
    for (adapter, sha256, price), load_us in sorted(priced.items()):
        tokens: dict[str, int] = defaultdict(int)
        requests: dict[str, int] = defaultdict(int)
        for used, used_sha256, tenant, n_tokens, n_requests in users:
            if used == adapter and used_sha256 in (None, sha256):
                tokens[tenant] += int(n_tokens)
                requests[tenant] += int(n_requests)
        if not requests:
            continue  # loaded but never used in the period: no request to carry it
        # Requests that produced no token at all (e.g. all failed early) share the load time equally.
        weights = tokens if sum(tokens.values()) > 0 else requests
        for tenant, share in apportion(load_us, weights).items():
            shares[(tenant, adapter, sha256, price)] += share
    # A user that carries none of a load (no token where others had some) gets no share: a 0 us share made a line of zeros.
    return [Share(*key, us) for key, us in sorted(shares.items()) if us > 0]


def frozen_spread(session: Session, period: str, tenant_id: str | None = None) -> list[Share]:
    """The cold-start spread stored when `period` was first closed."""
    statement = select(
        ColdStartShare.tenant_id, ColdStartShare.adapter, ColdStartShare.adapter_sha256, ColdStartShare.gpu_price_per_hour, ColdStartShare.share_us
    ).where(ColdStartShare.period == period, ColdStartShare.share_us > 0)  # spreads frozen before 0 us shares were left out kept them
    if tenant_id is not None:
        statement = statement.where(ColdStartShare.tenant_id == tenant_id)
    return [Share(*row) for row in session.execute(statement)]


def add_cold_start(tallies: dict[str, dict[LineKey, Tally]], shares: list[Share]) -> None:
    """Add each share to its tenant's line of that adapter and price (a line of its own if it had no usage)."""
    for share in shares:
        lines = tallies.setdefault(share.tenant_id, {})
        key = LineKey(share.adapter, None, share.gpu_price_per_hour)
        lines.setdefault(key, Tally()).cold_start_us += share.share_us
