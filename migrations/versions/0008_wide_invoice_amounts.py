"""Frozen invoice amounts of 38 digits: invoices and invoice_lines `cost` and `revenue` as numeric(38, 9).

numeric(18, 9) holds less than 10^9, and a month's cost is a price times GPU time: at 40,000 IDR an hour, 36
GPUs busy for a month cost 1,036,800,000, and PostgreSQL refused to close the month ("numeric field overflow")
that SQLite, which keeps money as text, closed. Prices keep numeric(18, 9) (billing.prices.check_price keeps them
below 10^9); the amounts get 29 integer digits (billing.types.Amount). Raising a numeric's precision at the same
scale rewrites no row on PostgreSQL. On SQLite the columns are text already: nothing changes. The downgrade
narrows them again, and fails on an amount of 10^9 or more, which numeric(18, 9) cannot hold.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_AMOUNTS = (("invoices", "cost"), ("invoices", "revenue"), ("invoice_lines", "cost"), ("invoice_lines", "revenue"))


def _retype(old: sa.Numeric, new: sa.Numeric) -> None:
    if op.get_bind().dialect.name != "postgresql":
        return  # SQLite keeps money as text (billing.types.Money)
    for table, column in _AMOUNTS:
        op.alter_column(table, column, type_=new, existing_type=old, existing_nullable=False)


def upgrade() -> None:
    _retype(sa.Numeric(18, 9), sa.Numeric(38, 9))


def downgrade() -> None:
    _retype(sa.Numeric(38, 9), sa.Numeric(18, 9))
