"""Unbilled work: gpu_busy.unbilled_us, measured busy time whose requests no usage row bills.

Two things run requests on the GPU and then write no usage row with their time: an engine process that dies
(its requests in flight are answered `engine_failed` with no time on them, the tenant is not charged for the
crash) and a revoked partition's job abandoned mid-run (the new owner runs it again and bills it). The worker
now names that time on its next busy record, so that `lorabatch report reconcile` shows it as unbilled work
instead of unexplained busy time. Rows written before this revision hold 0.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("gpu_busy", sa.Column("unbilled_us", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("gpu_busy") as batch:
        batch.drop_column("unbilled_us")
