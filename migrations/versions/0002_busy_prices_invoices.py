"""GPU busy records, price lists, billing periods, frozen invoices and cold-start shares; late-usage filing.

Revision ID: 0002
Revises: 0001
Create Date: 2026-02-01

usage and adapter_loads gain `invoice_period` (the period whose invoice bills the row: its own, or the
next open one for a row that arrived after its period closed). Existing rows are billed in their own
period. Adapter loads become idempotent on (worker_id, adapter, created_at); a worker loads one adapter
at a time, so two rows with that key are one load written twice, and the upgrade keeps the first.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIMESTAMP = sa.DateTime(timezone=True)
_MONEY = sa.Numeric(18, 9).with_variant(sa.String(40), "sqlite")  # billing.types.Money


def _add_invoice_period(table: str) -> None:
    op.add_column(table, sa.Column("invoice_period", sa.CHAR(7), nullable=True))
    op.execute(f"UPDATE {table} SET invoice_period = period")
    with op.batch_alter_table(table) as batch:
        batch.alter_column("invoice_period", existing_type=sa.CHAR(7), nullable=False)


def _amounts() -> list[sa.Column[int]]:
    """The integer amounts a frozen invoice and each of its lines keep: counts and microseconds."""
    names = ("requests", "failed", "input_tokens", "output_tokens", "cached_tokens", "base_us", "routing_us", "kv_saved_us", "cold_start_us")
    return [sa.Column(name, sa.BigInteger(), nullable=False) for name in names]


def upgrade() -> None:
    _add_invoice_period("usage")
    op.drop_index(op.f("ix_usage_tenant_id_period"), table_name="usage")
    op.create_index(op.f("ix_usage_tenant_id_invoice_period"), "usage", ["tenant_id", "invoice_period"])
    op.create_index(op.f("ix_usage_invoice_period_adapter"), "usage", ["invoice_period", "adapter"])

    _add_invoice_period("adapter_loads")
    op.execute(
        "DELETE FROM adapter_loads WHERE id NOT IN "
        "(SELECT MIN(id) FROM adapter_loads GROUP BY worker_id, adapter, created_at)"
    )
    with op.batch_alter_table("adapter_loads") as batch:
        batch.create_unique_constraint(op.f("uq_adapter_loads_worker_id_adapter_created_at"), ["worker_id", "adapter", "created_at"])
    op.create_index(op.f("ix_adapter_loads_invoice_period_adapter"), "adapter_loads", ["invoice_period", "adapter"])

    op.create_table(
        "gpu_busy",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("gpu_kind", sa.String(64), nullable=False),
        sa.Column("started_at", _TIMESTAMP, nullable=False),
        sa.Column("ended_at", _TIMESTAMP, nullable=False),
        sa.Column("busy_us", sa.BigInteger(), nullable=False),
        sa.Column("steps", sa.Integer(), nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_busy")),
        sa.UniqueConstraint("worker_id", "started_at", name=op.f("uq_gpu_busy_worker_id_started_at")),
    )
    op.create_index(op.f("ix_gpu_busy_period_worker_id"), "gpu_busy", ["period", "worker_id"])
    op.create_table(
        "gpu_prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("gpu_kind", sa.String(64), nullable=False),
        sa.Column("effective_from", _TIMESTAMP, nullable=False),
        sa.Column("price_per_hour", _MONEY, nullable=False),
        sa.Column("created_at", _TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("price_per_hour >= 0", name=op.f("ck_gpu_prices_price_not_negative")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_gpu_prices")),
        sa.UniqueConstraint("gpu_kind", "effective_from", name=op.f("uq_gpu_prices_gpu_kind_effective_from")),
    )
    op.create_table(
        "token_prices",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tier", sa.String(32), nullable=False),
        sa.Column("effective_from", _TIMESTAMP, nullable=False),
        sa.Column("input_per_million", _MONEY, nullable=False),
        sa.Column("output_per_million", _MONEY, nullable=False),
        sa.Column("created_at", _TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_token_prices")),
        sa.UniqueConstraint("tier", "effective_from", name=op.f("uq_token_prices_tier_effective_from")),
    )
    op.create_table(
        "billing_periods",
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.Column("spread_frozen_at", _TIMESTAMP, nullable=True),
        sa.Column("closed_at", _TIMESTAMP, nullable=True),
        sa.PrimaryKeyConstraint("period", name=op.f("pk_billing_periods")),
    )
    op.create_table(
        "cold_start_shares",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("adapter", sa.String(200), nullable=False),
        sa.Column("adapter_sha256", sa.CHAR(64), nullable=False),
        sa.Column("gpu_price_per_hour", _MONEY, nullable=False),
        sa.Column("share_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_cold_start_shares")),
    )
    op.create_index(op.f("ix_cold_start_shares_period_tenant_id"), "cold_start_shares", ["period", "tenant_id"])
    op.create_table(
        "invoices",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.Column("tier", sa.String(32), nullable=True),
        sa.Column("currency", sa.CHAR(3), nullable=False),
        sa.Column("closed_at", _TIMESTAMP, nullable=False),
        *_amounts(),
        sa.Column("unpriced_requests", sa.BigInteger(), nullable=False),
        sa.Column("cost", _MONEY, nullable=False),
        sa.Column("revenue", _MONEY, nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoices")),
        sa.UniqueConstraint("tenant_id", "period", name=op.f("uq_invoices_tenant_id_period")),
    )
    op.create_index(op.f("ix_invoices_period"), "invoices", ["period"])
    op.create_table(
        "invoice_lines",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("invoice_id", _ROW_ID, nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("adapter", sa.String(200), nullable=False),
        sa.Column("adjustment_for", sa.CHAR(7), nullable=True),
        sa.Column("gpu_price_per_hour", _MONEY, nullable=False),
        *_amounts(),
        sa.Column("cost", _MONEY, nullable=False),
        sa.Column("revenue", _MONEY, nullable=False),
        sa.ForeignKeyConstraint(["invoice_id"], ["invoices.id"], name=op.f("fk_invoice_lines_invoice_id_invoices"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invoice_lines")),
        sa.UniqueConstraint("invoice_id", "position", name=op.f("uq_invoice_lines_invoice_id_position")),
    )


def downgrade() -> None:
    op.drop_table("invoice_lines")
    op.drop_index(op.f("ix_invoices_period"), table_name="invoices")
    op.drop_table("invoices")
    op.drop_index(op.f("ix_cold_start_shares_period_tenant_id"), table_name="cold_start_shares")
    op.drop_table("cold_start_shares")
    op.drop_table("billing_periods")
    op.drop_table("token_prices")
    op.drop_table("gpu_prices")
    op.drop_index(op.f("ix_gpu_busy_period_worker_id"), table_name="gpu_busy")
    op.drop_table("gpu_busy")

    op.drop_index(op.f("ix_adapter_loads_invoice_period_adapter"), table_name="adapter_loads")
    with op.batch_alter_table("adapter_loads") as batch:
        batch.drop_constraint(op.f("uq_adapter_loads_worker_id_adapter_created_at"), type_="unique")
        batch.drop_column("invoice_period")

    op.drop_index(op.f("ix_usage_invoice_period_adapter"), table_name="usage")
    op.drop_index(op.f("ix_usage_tenant_id_invoice_period"), table_name="usage")
    op.create_index(op.f("ix_usage_tenant_id_period"), "usage", ["tenant_id", "period"])
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("invoice_period")
