"""Currency on price-list entries: gpu_prices.currency and token_prices.currency, the ledger.currency each was set in.

Prices were bare numbers, read in whatever ledger.currency the invoicing process had: after an operator switched it
(EUR to USD), an open month's drafts were labelled USD and priced with the numbers set in EUR. Each entry now records its
currency, and invoices price only with entries of their own (billing/prices.py).

Rows written before this revision take the currency of the process that runs the upgrade: `lorabatch db upgrade`
passes its ledger.currency (billing.db.upgrade's `currency`), `alembic ... upgrade` takes `-x currency=EUR`. That is the
currency every draft priced them in until now (a draft took the invoicing process's ledger.currency), so the upgrade
changes no amount and no label. Where price rows exist and no currency was named, the upgrade stops and changes
nothing rather than guess one; with no price rows there is nothing to label. The offline script (`--sql`) writes the
UPDATE only when `-x currency=` is given; without it, its NOT NULL step fails on a ledger that has price rows. The
downgrade drops both columns and keeps the rows; it is refused while the entries are in more than one currency, which
the columns' loss would make one (the offline script does not check).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-10
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import context, op

from billing.errors import LedgerConfigError

revision: str = "0012"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TABLES = ("gpu_prices", "token_prices")


def _currency() -> str | None:
    """The currency named for this upgrade, checked as ledger.currency is (three capital ASCII letters); None: none."""
    currency = context.config.attributes.get("currency") or context.get_x_argument(as_dictionary=True).get("currency")
    if currency is not None and not (len(currency) == 3 and currency.isascii() and currency.isalpha() and currency.isupper()):
        raise LedgerConfigError(f"currency {currency!r} is not a currency code: write its three-letter ISO 4217 code in capitals, "
                                f"such as USD")
    return currency


def upgrade() -> None:
    currency = _currency()
    if currency is None and not context.is_offline_mode():
        bind = op.get_bind()
        held = {table: bind.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one() for table in _TABLES}
        if any(held.values()):
            raise LedgerConfigError(
                f"revision 0012 records each price's currency, and this ledger holds prices ({held['gpu_prices']} GPU, "
                f"{held['token_prices']} token) with none named: upgrade with `lorabatch db upgrade` (it labels them with "
                f"ledger.currency) or `alembic -x currency=CODE ... upgrade head`, CODE the ledger.currency your invoices "
                f"are in now; nothing was changed")
    for table in _TABLES:
        op.add_column(table, sa.Column("currency", sa.CHAR(3), nullable=True))
        if currency is not None:
            op.execute(sa.table(table, sa.column("currency")).update().values(currency=currency))
        with op.batch_alter_table(table) as batch:
            batch.alter_column("currency", existing_type=sa.CHAR(3), nullable=False)


def downgrade() -> None:
    if not context.is_offline_mode():
        bind = op.get_bind()
        held = sorted({c for table in _TABLES for c in bind.execute(sa.text(f"SELECT DISTINCT currency FROM {table}")).scalars()})
        if len(held) > 1:
            raise LedgerConfigError(
                f"the price lists hold entries in {', '.join(held)}: below revision 0012 prices carry no currency, and every "
                f"draft would price them all as one, its ledger.currency; set the entries you keep in one currency (or "
                f"leave the ledger at 0012); nothing was changed")
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.drop_column("currency")
