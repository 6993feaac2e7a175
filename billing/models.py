"""The ledger's tables, under one `Base` whose MetaData names every constraint and index.

Alembic owns the schema (`migrations/`); these classes are what the code reads and writes, and a test
checks that the migrated database and these models agree.

Usage and adapter-load rows carry tenant ids and adapter names as plain text, not foreign keys into the
registry: the ledger records what happened, and a row must stay writable (and billable) whatever the
registry holds now, including for a tenant or adapter removed since.
"""

from __future__ import annotations

from datetime import datetime
from decimal import Decimal

from sqlalchemy import (
    CHAR,
    JSON,
    BigInteger,
    CheckConstraint,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    Numeric,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from billing.types import Amount, Money, UTCDateTime

# The schema revision these models describe is billing.db.SCHEMA_REVISION (kept there, beside the check of it, so that a
# command reading through SQLAlchemy Core checks it without importing the ORM models).

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_N_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# SQLite makes only a column declared exactly INTEGER PRIMARY KEY an auto-numbered rowid.
_ROW_ID = BigInteger().with_variant(Integer(), "sqlite")

# Money: Numeric(18, 9), never float. PostgreSQL stores it exactly. SQLite has no decimal type and keeps
# a double, which round-trips nine places exactly only below ~10^6 (15 significant digits): one request's
# cost is far below that, and sums of money are computed from integer microseconds, never from this column.
_MONEY = Numeric(18, 9)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"
    __table_args__ = (CheckConstraint("weight >= 1", name="weight_positive"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # e.g. "acme"
    display_name: Mapped[str] = mapped_column(String(200))
    tier: Mapped[str] = mapped_column(String(32), server_default="standard")
    weight: Mapped[int] = mapped_column(Integer, server_default=text("1"))  # fair-share weight between tenants
    # Rate limits the worker's scheduler enforces; 0 means unlimited.
    requests_per_minute: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    tokens_per_minute: Mapped[int] = mapped_column(BigInteger, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())


class Adapter(Base):
    """The adapter registry: one row per (tenant, name, version)."""

    __tablename__ = "adapters"
    # The unique index leads with (tenant_id, name), so it also serves lookups by tenant and name;
    # a second index on those two columns would only slow writes.
    __table_args__ = (UniqueConstraint("tenant_id", "name", "version"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), ForeignKey("tenants.id"))
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(CHAR(64))  # content hash of adapter_model.safetensors
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[Decimal] = mapped_column(Numeric(10, 4))
    target_modules: Mapped[list[str]] = mapped_column(JSON)  # e.g. ["q_proj", "v_proj"]
    nbytes: Mapped[int] = mapped_column(BigInteger)
    is_public: Mapped[bool] = mapped_column(server_default=false())
    is_default: Mapped[bool] = mapped_column(server_default=false())
    # Share of an unversioned name's traffic among its versions (canary); 0: reached only by name@version.
    traffic_weight: Mapped[int] = mapped_column(Integer, server_default=text("100"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())


class Usage(Base):
    """One row per (tenant, request_id): a request's measured GPU time and its cost at insert."""

    __tablename__ = "usage"
    __table_args__ = (
        UniqueConstraint("tenant_id", "request_id"),  # idempotency: redeliveries add no row
        CheckConstraint("status IN ('succeeded', 'failed')", name="status"),
        Index(None, "tenant_id", "invoice_period"),  # a tenant's invoice
        Index(None, "invoice_period", "adapter"),  # an adapter's requests on a period's invoices: the cold-start spread
        Index(None, "period", "adapter"),  # an adapter's requests of a month: the SRE report, conservation
    )

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(256))
    batch_id: Mapped[str | None] = mapped_column(String(256))
    adapter: Mapped[str | None] = mapped_column(String(200))  # "name@version"; None is the base model
    adapter_sha256: Mapped[str | None] = mapped_column(CHAR(64))
    status: Mapped[str] = mapped_column(String(16))
    error_code: Mapped[str | None] = mapped_column(String(64))
    route_reason: Mapped[str] = mapped_column(Text)
    input_tokens: Mapped[int] = mapped_column(Integer)
    output_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer)
    # Integer microseconds; BigInteger because a long request passes 2^31 us (36 minutes).
    base_us: Mapped[int] = mapped_column(BigInteger)
    lora_us: Mapped[int] = mapped_column(BigInteger)
    routing_us: Mapped[int] = mapped_column(BigInteger)
    kv_saved_us: Mapped[int] = mapped_column(BigInteger)
    queue_us: Mapped[int] = mapped_column(BigInteger)
    ttft_us: Mapped[int] = mapped_column(BigInteger)
    total_us: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[Decimal] = mapped_column(_MONEY)  # (base + lora + routing - kv_saved) at the price of the day
    period: Mapped[str] = mapped_column(CHAR(7))  # "YYYY-MM", the UTC month of created_at
    # The period whose invoice bills the row: its own period, or, for a row that arrived after its
    # tenant's invoice of that period was closed, the next period still open (an adjustment line there).
    invoice_period: Mapped[str] = mapped_column(CHAR(7))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    worker_id: Mapped[str] = mapped_column(String(128))
    # The result body the worker published (JSON text), so a resubmitted request is answered from here
    # instead of run again; NULL on rows written before revision 0004.
    result_json: Mapped[str | None] = mapped_column(Text)
    # The price-list key of the GPU that ran the request (billing/prices.py prices the row by it); NULL on rows written
    # before revision 0009, which are priced as ledger.gpu_kind of the process that reads them.
    gpu_kind: Mapped[str | None] = mapped_column(String(64))
    # The tenant's tier when the request ran (the registry snapshot the worker routed it with); its tokens are priced at
    # it. NULL on rows written before revision 0010 and for tenants the registry did not hold: priced at the tenant's
    # tier at invoice time.
    tier: Mapped[str | None] = mapped_column(String(32))


class UsageRedelivery(Base):
    """A copy of a request that ran again after its usage row was written: GPU busy time billed to nobody.

    The usage row that was written first bills the request; a later copy measured by another run (another
    worker, or another run of the job, finished at another instant) adds no usage row, and is kept here so that the busy time it
    took is named as redelivered work (billing/reconcile.py). A retried write of the same copy adds nothing.
    """

    __tablename__ = "usage_redeliveries"
    __table_args__ = (
        UniqueConstraint("tenant_id", "request_id", "worker_id", "created_at"),
        Index(None, "period"),
    )

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    request_id: Mapped[str] = mapped_column(String(256))
    worker_id: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)  # when the copy's run finished (its result reached its worker)
    period: Mapped[str] = mapped_column(CHAR(7))  # the UTC month of created_at
    adapter: Mapped[str | None] = mapped_column(String(200))
    base_us: Mapped[int] = mapped_column(BigInteger)
    lora_us: Mapped[int] = mapped_column(BigInteger)
    routing_us: Mapped[int] = mapped_column(BigInteger)


class AdapterLoad(Base):
    """One adapter load (a cold start), spread over the adapter's requests of its period."""

    __tablename__ = "adapter_loads"
    __table_args__ = (
        UniqueConstraint("worker_id", "adapter", "created_at"),  # a retried write adds no second load
        Index(None, "period", "adapter"),
        Index(None, "invoice_period", "adapter"),
    )

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    adapter: Mapped[str] = mapped_column(String(200))  # "name@version"
    adapter_sha256: Mapped[str] = mapped_column(CHAR(64))
    tenant_id: Mapped[str] = mapped_column(String(64))  # the adapter's owner
    tier: Mapped[str] = mapped_column(String(16))  # where it was loaded from: "disk" | "host"
    nbytes: Mapped[int] = mapped_column(BigInteger)
    load_us: Mapped[int] = mapped_column(BigInteger)
    worker_id: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    period: Mapped[str] = mapped_column(CHAR(7))
    # Its own period, or the next one whose cold-start spread is not frozen yet, when it arrived after
    # its own period's spread was (a load is billed once, in exactly one period's spread).
    invoice_period: Mapped[str] = mapped_column(CHAR(7))
    gpu_kind: Mapped[str | None] = mapped_column(String(64))  # as Usage.gpu_kind: the GPU it was loaded onto


class Busy(Base):
    """GPU busy time of one worker over one engine batch or flush interval: the sum of its measured steps."""

    __tablename__ = "gpu_busy"
    __table_args__ = (
        UniqueConstraint("worker_id", "started_at"),  # idempotency: a retried flush adds no second record
        Index(None, "period", "worker_id"),
        Index(None, "carried_to"),  # a month's busy time carried in from the month before: reconcile
    )

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    worker_id: Mapped[str] = mapped_column(String(128))
    gpu_kind: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime] = mapped_column(UTCDateTime)
    busy_us: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int] = mapped_column(Integer)
    period: Mapped[str] = mapped_column(CHAR(7))  # the UTC month of started_at
    # Of the busy time measured so far, what requests that no usage row bills took (billing.records.BusyRecord)
    unbilled_us: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # Of the busy time measured in `period`, what requests billed in a later month took (billing.records.BusyRecord):
    # non-zero only on a month's last record, and owed by `carried_to`, the month of ended_at (NULL when nothing is).
    carried_us: Mapped[int] = mapped_column(BigInteger, server_default="0")
    carried_to: Mapped[str | None] = mapped_column(CHAR(7))


class GpuPrice(Base):
    """The cost side: what one hour of a GPU kind costs, from a UTC day on until the next entry."""

    __tablename__ = "gpu_prices"
    __table_args__ = (UniqueConstraint("gpu_kind", "effective_from"), CheckConstraint("price_per_hour >= 0", name="price_not_negative"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    gpu_kind: Mapped[str] = mapped_column(String(64))
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime)  # midnight UTC of the first day it applies
    price_per_hour: Mapped[Decimal] = mapped_column(Money)
    currency: Mapped[str] = mapped_column(CHAR(3))  # the ledger.currency it was set in (revision 0012)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())


class TokenPrice(Base):
    """The revenue side: what a tenant tier pays per million input and per million output tokens."""

    __tablename__ = "token_prices"
    __table_args__ = (UniqueConstraint("tier", "effective_from"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tier: Mapped[str] = mapped_column(String(32))
    effective_from: Mapped[datetime] = mapped_column(UTCDateTime)
    input_per_million: Mapped[Decimal] = mapped_column(Money)
    output_per_million: Mapped[Decimal] = mapped_column(Money)
    currency: Mapped[str] = mapped_column(CHAR(3))  # as GpuPrice.currency
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())


class BillingPeriod(Base):
    """A billing period's state, and the row that writers and closers lock to agree on it.

    Writers hold it FOR SHARE while they file rows into the period; closing takes it FOR UPDATE, so a
    close waits for writes in flight and later writes see the period (or the tenant's invoice) closed.
    """

    __tablename__ = "billing_periods"

    period: Mapped[str] = mapped_column(CHAR(7), primary_key=True)
    spread_frozen_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # cold-start spread computed and stored
    closed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # every tenant's invoice closed


class ColdStartShare(Base):
    """A tenant's frozen share, in us, of an adapter's load time billed to a period (at the load's GPU price)."""

    __tablename__ = "cold_start_shares"
    __table_args__ = (Index(None, "period", "tenant_id"),)

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    period: Mapped[str] = mapped_column(CHAR(7))
    tenant_id: Mapped[str] = mapped_column(String(64))
    adapter: Mapped[str] = mapped_column(String(200))
    adapter_sha256: Mapped[str] = mapped_column(CHAR(64))
    gpu_price_per_hour: Mapped[Decimal] = mapped_column(Money)
    share_us: Mapped[int] = mapped_column(BigInteger)


class _FrozenAmounts:
    """The integer amounts a closed invoice and each of its lines keep: counts and microseconds."""

    requests: Mapped[int] = mapped_column(BigInteger)
    failed: Mapped[int] = mapped_column(BigInteger)
    input_tokens: Mapped[int] = mapped_column(BigInteger)
    output_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    base_us: Mapped[int] = mapped_column(BigInteger)
    lora_us: Mapped[int] = mapped_column(BigInteger)  # the LoRA compute (split out of routing_us by 0006)
    routing_us: Mapped[int] = mapped_column(BigInteger)  # the routing decisions alone
    kv_saved_us: Mapped[int] = mapped_column(BigInteger)
    cold_start_us: Mapped[int] = mapped_column(BigInteger)


class ClosedInvoice(_FrozenAmounts, Base):
    """A closed (frozen) invoice: its totals as they were at close. Drafts are computed, never stored."""

    __tablename__ = "invoices"
    __table_args__ = (UniqueConstraint("tenant_id", "period"), Index(None, "period"))

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64))
    period: Mapped[str] = mapped_column(CHAR(7))
    tier: Mapped[str | None] = mapped_column(String(32))  # the tenant's tier at close; None: not registered
    currency: Mapped[str] = mapped_column(CHAR(3))
    closed_at: Mapped[datetime] = mapped_column(UTCDateTime)
    unpriced_requests: Mapped[int] = mapped_column(BigInteger)
    cost: Mapped[Decimal] = mapped_column(Amount)
    revenue: Mapped[Decimal] = mapped_column(Amount)


class ClosedInvoiceLine(_FrozenAmounts, Base):
    """One frozen line of a closed invoice, in the order it is rendered."""

    __tablename__ = "invoice_lines"
    __table_args__ = (UniqueConstraint("invoice_id", "position"),)

    id: Mapped[int] = mapped_column(_ROW_ID, primary_key=True)
    invoice_id: Mapped[int] = mapped_column(ForeignKey("invoices.id", ondelete="CASCADE"))
    position: Mapped[int] = mapped_column(Integer)
    adapter: Mapped[str] = mapped_column(String(200))  # "name@version" or "base"
    adjustment_for: Mapped[str | None] = mapped_column(CHAR(7))  # the period of late usage billed here
    gpu_price_per_hour: Mapped[Decimal] = mapped_column(Money)
    cost: Mapped[Decimal] = mapped_column(Amount)
    revenue: Mapped[Decimal] = mapped_column(Amount)


class RouteRuleRow(Base):
    """L3 routing rules: a tenant's keyword, regex and prefix rules, matched in `position` order."""

    __tablename__ = "route_rules"
    __table_args__ = (
        CheckConstraint("kind IN ('keyword', 'regex', 'prefix')", name="kind"),
        Index(None, "tenant_id", "position"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    tenant_id: Mapped[str] = mapped_column(String(64), ForeignKey("tenants.id"))
    kind: Mapped[str] = mapped_column(String(16))
    pattern: Mapped[str] = mapped_column(Text)
    adapter: Mapped[str] = mapped_column(String(200))  # name or name@version
    position: Mapped[int] = mapped_column(Integer, server_default=text("0"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())
