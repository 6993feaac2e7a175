"""The tenant's tier on usage rows: usage.tier, the tier its tenant had in the registry the worker routed it with.

Before, invoices priced every row's tokens at the tenant's tier at invoice time: a tenant moved from standard to
premium on the 20th had the whole month's tokens priced at premium, and a draft re-made after a tier change re-priced
requests that had already run. Rows are now priced at their own tier. Rows written before this revision (and rows of
tenants the registry did not hold) hold NULL and are priced as before, at the tenant's tier at invoice time. The
downgrade drops the column and keeps the rows.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-07
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | Sequence[str] | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("usage", sa.Column("tier", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("usage") as batch:
        batch.drop_column("tier")
