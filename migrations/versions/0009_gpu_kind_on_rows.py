"""The GPU kind on usage and adapter-load rows: usage.gpu_kind and adapter_loads.gpu_kind, the price-list key of the GPU
that ran the request (or took the load), as the worker's ledger.gpu_kind named it.

Before, only gpu_busy recorded the kind, and invoices priced every row at the kind of the invoicing process's own
config: a `lorabatch invoice --close-period` run with another ledger.gpu_kind than the workers' froze every hour at
the wrong price, and a fleet of two kinds could not be priced at all. Rows are now priced by their own kind. Rows
written before this revision hold NULL and are priced as before, as the reading process's ledger.gpu_kind. The
downgrade drops the columns and keeps the rows.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("usage", "adapter_loads")


def upgrade() -> None:
    for table in _TABLES:
        op.add_column(table, sa.Column("gpu_kind", sa.String(64), nullable=True))


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("gpu_kind")
