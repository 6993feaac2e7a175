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

from billing.types import UTCDateTime

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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, server_default=func.now())


class Usage(Base):
    """One row per (tenant, request_id): a request's measured GPU time and its cost at insert."""

    __tablename__ = "usage"
    __table_args__ = (
        UniqueConstraint("tenant_id", "request_id"),  # idempotency: redeliveries add no row
        CheckConstraint("status IN ('succeeded', 'failed')", name="status"),
        Index(None, "tenant_id", "period"),  # a tenant's invoice
        Index(None, "period", "adapter"),  # an adapter's requests of a period, for the cold-start spread
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
    created_at: Mapped[datetime] = mapped_column(UTCDateTime)
    worker_id: Mapped[str] = mapped_column(String(128))


class AdapterLoad(Base):
    """One adapter load (a cold start), spread over the adapter's requests of its period."""

    __tablename__ = "adapter_loads"
    __table_args__ = (Index(None, "period", "adapter"),)

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
