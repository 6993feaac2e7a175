"""Redelivered work: usage_redeliveries, the copies of a request that ran again after its usage row was written.

The usage row stays the one that bills (first written wins); a copy that a second run measured (another
worker, or another receipt) is kept here, so that the GPU busy time it took is named as redelivered
work in `lorabatch report reconcile` instead of showing as unexplained.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "usage_redeliveries",
        sa.Column("id", _ROW_ID, nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("request_id", sa.String(256), nullable=False),
        sa.Column("worker_id", sa.String(128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period", sa.CHAR(7), nullable=False),
        sa.Column("adapter", sa.String(200), nullable=True),
        sa.Column("base_us", sa.BigInteger(), nullable=False),
        sa.Column("lora_us", sa.BigInteger(), nullable=False),
        sa.Column("routing_us", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_usage_redeliveries")),
        sa.UniqueConstraint("tenant_id", "request_id", "worker_id", "created_at",
                            name=op.f("uq_usage_redeliveries_tenant_id_request_id_worker_id_created_at")),
    )
    op.create_index(op.f("ix_usage_redeliveries_period"), "usage_redeliveries", ["period"])


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_redeliveries_period"), table_name="usage_redeliveries")
    op.drop_table("usage_redeliveries")
