"""An invoice as JSON, CSV (RFC 4180) and an aligned text table; decimals always in fixed-point text."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import fields
from datetime import UTC, datetime
from decimal import Decimal

from billing.credit import KV_CREDIT_RULE
from billing.invoice import Invoice, InvoiceAmounts

AMOUNT_KEYS = tuple(f.name for f in fields(InvoiceAmounts))


def decimal_text(value: Decimal) -> str:
    """Fixed-point text of a Decimal ("0.000000000", never "0E-9" or "-0.000")."""
    return format(value if value else abs(value), "f")


# A spreadsheet opening a CSV runs a cell that starts with one of these as a formula ("=cmd|' /C calc'!A0", "@SUM(..)"):
# a text cell that does is written behind a "'", which the spreadsheet shows as text. Numbers are never text cells here.
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def csv_text(value: str) -> str:
    """A text cell as a CSV carries it: a leading "'" where a spreadsheet would read the text as a formula (a tier set as
    "=HYPERLINK(...)" opened as a live link in the finance report's CSV)."""
    return "'" + value if value.startswith(_FORMULA_STARTS) else value


def plain_text(value: str) -> str:
    """Text for an aligned table: a control character (a newline in a tier's name broke its row in two) written as its
    escape, "\\n"."""
    return value if value.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in value)


def price_text(value: Decimal) -> str:
    """A unit price with its trailing zeros cut down to two places: 7.200000000 -> "7.20", 0.0001 -> "0.0001"."""
    exponent = value.normalize().as_tuple().exponent
    assert isinstance(exponent, int), value
    return decimal_text(value.quantize(Decimal(1).scaleb(min(exponent, -2))))


def instant_text(value: datetime) -> str:
    """A UTC instant as the invoice writes it, to the second: "2026-04-01T00:00:05Z" (stored instants are UTC)."""
    return (value.astimezone(UTC) if value.tzinfo is not None else value).strftime("%Y-%m-%dT%H:%M:%SZ")


def _closed_at(invoice: Invoice) -> str | None:
    return None if invoice.closed_at is None else instant_text(invoice.closed_at)


def _amounts(amounts: InvoiceAmounts) -> dict[str, int | str]:
    values = {key: getattr(amounts, key) for key in AMOUNT_KEYS}
    return {key: decimal_text(v) if isinstance(v, Decimal) else v for key, v in values.items()}


def invoice_document(invoice: Invoice) -> dict[str, object]:
    """The invoice as plain JSON values: tenant, period, status, when it was closed (null for a draft), currency, the
    tiers its tokens were priced at, lines, totals, and the rule its KV credit follows."""
    return {
        "tenant": invoice.tenant,
        "period": invoice.period,
        "status": invoice.status,
        "closed_at": _closed_at(invoice),
        "currency": invoice.currency,
        "tiers_billed": list(invoice.tiers_billed),
        "lines": [
            {"adapter": line.adapter, "adjustment_for": line.adjustment_for, "gpu_price_per_hour": price_text(line.gpu_price_per_hour), **_amounts(line)}
            for line in invoice.lines
        ],
        "totals": {**_amounts(invoice.totals), "unpriced_requests": invoice.unpriced_requests},
        "kv_credit_rule": KV_CREDIT_RULE,
    }


def render_json(invoice: Invoice) -> str:
    """The invoice as JSON; decimals as strings."""
    return json.dumps(invoice_document(invoice), indent=2)


# Columns are only ever appended (a reader may take them by position): closed_at and tiers_billed came last.
CSV_COLUMNS = ("tenant", "period", "status", "currency", "adapter", "adjustment_for", "gpu_price_per_hour", *AMOUNT_KEYS,
               "unpriced_requests", "closed_at", "tiers_billed")


def csv_header() -> str:
    """The CSV's header line alone: what a month with no invoice to close prints, so a reader still finds its columns."""
    out = io.StringIO()
    csv.writer(out).writerow(CSV_COLUMNS)
    return out.getvalue()


def render_csv(invoice: Invoice) -> str:
    """One row per line and a final TOTAL row (with the unpriced requests), each with the tenant, period, status and
    currency, and at its end when the invoice was closed (empty for a draft) and the tiers its tokens were priced at
    (a JSON array: a tier's name may hold spaces or commas)."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    head = tuple(map(csv_text, (invoice.tenant, invoice.period, invoice.status, invoice.currency)))
    tail = (_closed_at(invoice) or "", json.dumps(list(invoice.tiers_billed)))
    for line in invoice.lines:
        writer.writerow((*head, csv_text(line.adapter), line.adjustment_for or "", price_text(line.gpu_price_per_hour), *_amounts(line).values(), "", *tail))
    writer.writerow((*head, "TOTAL", "", "", *_amounts(invoice.totals).values(), invoice.unpriced_requests, *tail))
    return out.getvalue()


def _title(invoice: Invoice) -> str:
    status = invoice.status
    if invoice.closed_at is not None:
        status += " " + instant_text(invoice.closed_at)
    prices = sorted({line.gpu_price_per_hour for line in invoice.lines})
    at = f" at {', '.join(map(price_text, prices))} per GPU hour" if prices else ""
    return f"Invoice {plain_text(invoice.tenant)} {invoice.period} ({status}), {invoice.currency}{at}"


def render_table(invoice: Invoice) -> str:
    """The invoice as an aligned text table: labels left-aligned, numbers right-aligned, totals last."""
    header = ("adapter", "gpu_price", *AMOUNT_KEYS)
    body = [(plain_text(line.label), price_text(line.gpu_price_per_hour), *map(str, _amounts(line).values())) for line in invoice.lines]
    total = ("total", "", *map(str, _amounts(invoice.totals).values()))
    widths = [max(len(row[i]) for row in (header, *body, total)) for i in range(len(header))]

    def row_text(row: tuple[str, ...]) -> str:
        return "  ".join([row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))])

    rule = "  ".join("-" * w for w in widths)
    notes = []
    tiers = invoice.tiers_billed
    if len(tiers) > 1:
        notes.append(f"note: tokens priced at tiers {', '.join(map(repr, tiers))}: each request at the tier its tenant had "
                     f"when it ran")
    if invoice.unpriced_requests:
        if len(tiers) > 1:
            tier = f"one of tiers {', '.join(map(repr, tiers))}"
        else:
            tier = "no tier (tenant not registered)" if invoice.tier is None and not tiers else f"tier {(tiers or (invoice.tier,))[0]!r}"
        notes.append(f"note: {invoice.unpriced_requests} succeeded requests earned nothing: {tier} had no token price then "
                     f"(set one with `lorabatch prices set-tokens`)")
    return "\n".join([_title(invoice), row_text(header), rule, *map(row_text, body), rule, row_text(total), *notes]) + "\n"
