"""Closed invoices keep the LoRA compute apart from the routing decisions: invoices.lora_us, invoice_lines.lora_us.

Until now a frozen line's routing_us held the routing decisions plus the LoRA compute of its requests.
This revision adds lora_us and moves the LoRA part out of routing_us, so that routing_us is the routing
decisions alone, as in the usage rows and the SRE report. base + lora + routing - kv_saved + cold_start
is the same number before and after; cost and revenue are not touched.

The LoRA part of a frozen line is the sum of usage.lora_us over the requests it billed: the tenant's
rows filed to the invoice's period, of the line's adapter and own month. A tenant's (adapter, month)
billed at one GPU price is one line and takes that sum whole. Where a price change within the month
made several lines of one (adapter, month), the rows are priced as the close priced them: by the GPU
price list of one kind in effect at each row's created_at, rows before every entry at the fallback
price, a price that the lines name; the kind and fallback whose per-price sums of requests, base_us and
routing_us + lora_us reproduce the frozen lines are used. Where none does (usage rows no longer match
the frozen amounts), the line keeps its merged routing_us and lora_us 0, and the revision says so.
Lines alone in their (adapter, month) are split in plain SQL, so `alembic upgrade --sql` splits them too;
the price-change case reads the ledger and runs only online.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from decimal import Decimal

import sqlalchemy as sa
from alembic import context, op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

log = logging.getLogger("alembic.runtime.migration")

_TABLES = ("invoices", "invoice_lines")


def _price(value: object) -> Decimal:
    """A money column as read by a plain query: text on SQLite, numeric on PostgreSQL."""
    return Decimal(str(value)).quantize(Decimal("0.000000001"))


# The usage rows a frozen line billed, for a correlated subquery on invoice_lines: the invoice's tenant, filed
# to its period, of the line's adapter and own month.
_ROWS_OF_LINE = (
    "FROM usage u JOIN invoices i ON i.id = invoice_lines.invoice_id WHERE u.tenant_id = i.tenant_id "
    "AND u.invoice_period = i.period AND COALESCE(u.adapter, 'base') = invoice_lines.adapter "
    "AND u.period = COALESCE(invoice_lines.adjustment_for, i.period)"
)
# Another line of the same invoice, adapter and own month: a GPU price change made it.
_PRICE_SPLIT = (
    "EXISTS (SELECT 1 FROM invoice_lines l2 WHERE l2.invoice_id = invoice_lines.invoice_id AND l2.adapter = invoice_lines.adapter "
    "AND COALESCE(l2.adjustment_for, '') = COALESCE(invoice_lines.adjustment_for, '') AND l2.id <> invoice_lines.id)"
)


def _split_single_lines() -> None:
    """Lines alone in their (invoice, adapter, month) take their rows' LoRA time whole, where the rows still
    reproduce the line's requests, base_us and merged routing_us. Plain SQL: `alembic upgrade --sql` renders it."""
    op.execute(
        f"UPDATE invoice_lines SET lora_us = (SELECT COALESCE(SUM(u.lora_us), 0) {_ROWS_OF_LINE}) "
        f"WHERE NOT {_PRICE_SPLIT} "
        f"AND requests = (SELECT COUNT(*) {_ROWS_OF_LINE}) "
        f"AND base_us = (SELECT COALESCE(SUM(u.base_us), 0) {_ROWS_OF_LINE}) "
        f"AND routing_us = (SELECT COALESCE(SUM(u.routing_us + u.lora_us), 0) {_ROWS_OF_LINE})"
    )


def _price(value: object) -> Decimal:
    """A money column as a plain query reads it: text on SQLite, numeric on PostgreSQL."""
    return Decimal(str(value)).quantize(Decimal("0.000000001"))


def _split_price_lines(bind: sa.Connection) -> int:
    """Lines of one (invoice, adapter, month) at several GPU prices: each takes the LoRA time of the rows
    priced at its price, under the price list (kind, fallback) that reproduces every line. Returns how
    many such lines no price list reproduces (they keep lora_us 0)."""
    lines = bind.execute(sa.text(
        "SELECT l.id, l.invoice_id, i.tenant_id, i.period, l.adapter, l.adjustment_for, l.gpu_price_per_hour, "
        f"l.requests, l.base_us, l.routing_us FROM invoice_lines l JOIN invoices i ON i.id = l.invoice_id "
        f"WHERE {_PRICE_SPLIT.replace('invoice_lines.', 'l.')}"
    )).all()
    groups: dict[tuple, list] = defaultdict(list)
    for line in lines:
        groups[(line.invoice_id, line.tenant_id, line.period, line.adapter, line.adjustment_for)].append(line)
    kinds = [kind for kind, in bind.execute(sa.text("SELECT DISTINCT gpu_kind FROM gpu_prices ORDER BY gpu_kind"))]
    unsplit = 0
    for (_, tenant, period, adapter, adjustment_for), group in groups.items():
        params = {"tenant": tenant, "period": period, "adapter": adapter, "own": adjustment_for or period}
        wanted = {_price(line.gpu_price_per_hour): (line.requests, line.base_us, line.routing_us) for line in group}
        found = None
        for kind in kinds:
            rows = bind.execute(sa.text(
                "SELECT (SELECT g.price_per_hour FROM gpu_prices g WHERE g.gpu_kind = :kind AND g.effective_from <= u.created_at "
                "ORDER BY g.effective_from DESC LIMIT 1) AS price, COUNT(*), SUM(u.base_us), SUM(u.routing_us + u.lora_us), "
                "SUM(u.lora_us) FROM usage u WHERE u.tenant_id = :tenant AND u.invoice_period = :period "
                "AND COALESCE(u.adapter, 'base') = :adapter AND u.period = :own GROUP BY 1"), {**params, "kind": kind}).all()
            for fallback in sorted(wanted):  # rows before every entry were priced at the fallback: one of the lines' prices
                sums: dict[Decimal, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
                for price, *amounts in rows:
                    key = fallback if price is None else _price(price)
                    sums[key] = [a + int(b) for a, b in zip(sums[key], amounts)]
                got = {p: tuple(s[:3]) for p, s in sums.items()}
                # A line of cold-start time alone has no rows: (0, 0, 0).
                if set(got) <= set(wanted) and all(got.get(p, (0, 0, 0)) == w for p, w in wanted.items()):
                    found = {p: s[3] for p, s in sums.items()}
                    break
            if found is not None:
                break
        if found is None:
            unsplit += len(group)
            continue
        for line in group:
            bind.execute(sa.text("UPDATE invoice_lines SET lora_us = :lora WHERE id = :id"),
                         {"lora": found.get(_price(line.gpu_price_per_hour), 0), "id": line.id})
    return unsplit


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("lora_us", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
    _split_single_lines()
    if context.is_offline_mode():
        log.warning("0006 --sql: closed invoice lines made by a GPU price change within a month are split only by an "
                    "online upgrade; in this script they keep routing_us with the LoRA time in it and lora_us 0")
    elif unsplit := _split_price_lines(op.get_bind()):
        log.warning("0006: %d closed invoice lines no longer match their usage rows; they keep routing_us with the LoRA "
                    "time in it and lora_us 0", unsplit)
    op.execute("UPDATE invoice_lines SET routing_us = routing_us - lora_us")
    # An invoice's totals are the sums of its lines.
    op.execute("UPDATE invoices SET lora_us = COALESCE((SELECT SUM(l.lora_us) FROM invoice_lines l WHERE l.invoice_id = invoices.id), 0)")
    op.execute("UPDATE invoices SET routing_us = routing_us - lora_us")
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            batch.alter_column("lora_us", server_default=None, existing_type=sa.BigInteger(), existing_nullable=False)


def downgrade() -> None:
    for table in _TABLES:
        op.execute(f"UPDATE {table} SET routing_us = routing_us + lora_us")
        with op.batch_alter_table(table) as batch:
            batch.drop_column("lora_us")
