"""The ledger's first schema: tenants, the adapter registry, usage rows and adapter loads.

Revision ID: 0001
Revises:
Create Date: 2026-01-01

Constraint and index names are written out as the naming convention in billing/models.py produces
them, so later revisions can drop or alter them by name on every backend.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_TIMESTAMP = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "tenants",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("display_name", sa.String(200), nullable=False),
        sa.Column("tier", sa.String(32), server_default="standard", nullable=False),
        sa.Column("weight", sa.Integer(), server_default=sa.text("1"), nullable=False),
        sa.Column("created_at", _TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("weight >= 1", name=op.f("ck_tenants_weight_positive")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenants")),
    )
    op.create_table(
        "adapters",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.CHAR(64), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("alpha", sa.Numeric(10, 4), nullable=False),
        sa.Column("target_modules", sa.JSON(), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("is_public", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("is_default", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("created_at", _TIMESTAMP, server_default=sa.func.now(), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name=op.f("fk_adapters_tenant_id_tenants")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapters")),
        sa.UniqueConstraint("tenant_id", "name", "version", name=op.f("uq_adapters_tenant_id_name_version")),
    )
    op.create_table(
        "usage",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("batch_id", sa.String(256), nullable=True),
        sa.Column("adapter", sa.String(200), nullable=True),
        sa.Column("adapter_sha256", sa.CHAR(64), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("route_reason", sa.Text(), nullable=False),
        sa.Column("input_tokens", sa.Integer(), nullable=False),
        sa.Column("output_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_tokens", sa.Integer(), nullable=False),
        sa.Column("base_us", sa.BigInteger(), nullable=False),
        sa.Column("lora_us", sa.BigInteger(), nullable=False),
        sa.Column("routing_us", sa.BigInteger(), nullable=False),
        sa.Column("kv_saved_us", sa.BigInteger(), nullable=False),
        sa.Column("queue_us", sa.BigInteger(), nullable=False),
        sa.Column("ttft_us", sa.BigInteger(), nullable=False),
        sa.Column("total_us", sa.BigInteger(), nullable=False),
        sa.Column("cost", sa.Numeric(18, 9), nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.Column("created_at", _TIMESTAMP, nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.CheckConstraint("status IN ('succeeded', 'failed')", name=op.f("ck_usage_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage")),
        sa.UniqueConstraint("tenant_id", "request_id", name=op.f("uq_usage_tenant_id_request_id")),
    )
    op.create_index(op.f("ix_usage_tenant_id_period"), "usage", ["tenant_id", "period"])
    op.create_index(op.f("ix_usage_period_adapter"), "usage", ["period", "adapter"])
    op.create_table(
        "adapter_loads",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("adapter", sa.String(200), nullable=False),
        sa.Column("adapter_sha256", sa.CHAR(64), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("tier", sa.String(16), nullable=False),
        sa.Column("nbytes", sa.BigInteger(), nullable=False),
        sa.Column("load_us", sa.BigInteger(), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("created_at", _TIMESTAMP, nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_adapter_loads")),
    )
    op.create_index(op.f("ix_adapter_loads_period_adapter"), "adapter_loads", ["period", "adapter"])


def downgrade() -> None:
    op.drop_index(op.f("ix_adapter_loads_period_adapter"), table_name="adapter_loads")
    op.drop_table("adapter_loads")
    op.drop_index(op.f("ix_usage_period_adapter"), table_name="usage")
    op.drop_index(op.f("ix_usage_tenant_id_period"), table_name="usage")
    op.drop_table("usage")
    op.drop_table("adapters")
    op.drop_table("tenants")
