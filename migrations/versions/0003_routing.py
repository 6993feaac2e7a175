"""Routing and scheduling: tenant rate limits, adapter traffic weights (canary), L3 route rules.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.add_column(sa.Column("requests_per_minute", sa.Integer(), server_default=sa.text("0"), nullable=False))
        batch.add_column(sa.Column("tokens_per_minute", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    with op.batch_alter_table("adapters") as batch:
        batch.add_column(sa.Column("traffic_weight", sa.Integer(), server_default=sa.text("100"), nullable=False))
    # Until now the newest version of a name took all its traffic: keep that for existing rows.
    op.execute(
        "UPDATE adapters SET traffic_weight = 0 WHERE version < "
        "(SELECT MAX(a2.version) FROM adapters a2 WHERE a2.tenant_id = adapters.tenant_id AND a2.name = adapters.name)"
    )
    op.create_table(
        "route_rules",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("tenant_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("adapter", sa.String(200), nullable=False),
        sa.Column("position", sa.Integer(), server_default=sa.text("0"), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.CheckConstraint("kind IN ('keyword', 'regex', 'prefix')", name="ck_route_rules_kind"),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], name="fk_route_rules_tenant_id_tenants"),
        sa.PrimaryKeyConstraint("id", name="pk_route_rules"),
    )
    op.create_index("ix_route_rules_tenant_id_position", "route_rules", ["tenant_id", "position"])


def downgrade() -> None:
    op.drop_index("ix_route_rules_tenant_id_position", table_name="route_rules")
    op.drop_table("route_rules")
    with op.batch_alter_table("adapters") as batch:
        batch.drop_column("traffic_weight")
    with op.batch_alter_table("tenants") as batch:
        batch.drop_column("tokens_per_minute")
        batch.drop_column("requests_per_minute")
