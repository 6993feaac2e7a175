"""Carried busy time: gpu_busy.carried_us and carried_to, a month's busy time that requests billed in a later month took.

A usage row's month and prices were those of the instant the worker received the job, while the busy time its GPU work
took is on busy records of the month the GPU ran it: a job received before midnight UTC at a month's end and run after
it was billed in the old month at the old prices, its busy time measured in the new month, and `report reconcile` showed
unexplained busy time in both months at every busy month boundary. Rows are now stamped when the request's GPU work
finished, and the worker names, on a month's last busy record, the busy time of that month that rows of a later month
bill (requests still running at the record's end, or finished after midnight): carried_us, owed by carried_to (the
month of the record's ended_at). Rows written before this revision hold 0 and NULL; rows already written keep their
month. The downgrade drops both columns and the index and keeps the rows.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | Sequence[str] | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("gpu_busy", sa.Column("carried_us", sa.BigInteger(), nullable=False, server_default="0"))
    op.add_column("gpu_busy", sa.Column("carried_to", sa.CHAR(7), nullable=True))
    op.create_index(op.f("ix_gpu_busy_carried_to"), "gpu_busy", ["carried_to"])


def downgrade() -> None:
    op.drop_index(op.f("ix_gpu_busy_carried_to"), table_name="gpu_busy")
    with op.batch_alter_table("gpu_busy") as batch:
        batch.drop_column("carried_to")
        batch.drop_column("carried_us")
