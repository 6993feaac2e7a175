"""Read a rendered report back, whatever its format, into one canonical form, so that formats can be compared.

Canonical form: {section: [row, ...]} where the summary is the one-row section "summary" and every row
maps a column to its text, empty values left out (JSON's null and false, CSV's and HTML's empty cells,
the text table's "-"), and a table without rows left out (CSV has no way to show one). Two renderings
carry the same figures exactly when their canonical forms are equal.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable
from html.parser import HTMLParser

Canonical = dict[str, list[dict[str, str]]]


def _json_text(value: object) -> str:
    if value is None or value is False:
        return ""
    if value is True:
        return "yes"
    return str(value)


def _row(pairs: object) -> dict[str, str]:
    return {k: v for k, v in pairs if v != ""}  # type: ignore[attr-defined]


def from_json(text: str) -> Canonical:
    document = json.loads(text)
    out: Canonical = {"summary": [_row((k, _json_text(v)) for k, v in document["summary"].items())]}
    for name, rows in document.items():
        if name not in ("report", "period", "summary"):
            out[name] = [_row((k, _json_text(v)) for k, v in row.items()) for row in rows]
    return out


def from_csv(text: str) -> Canonical:
    out: Canonical = {}
    for row in csv.DictReader(io.StringIO(text)):
        section = row.pop("section")
        out.setdefault(section, []).append(_row(row.items()))
    return out


def from_table(text: str) -> Canonical:
    lines = text.rstrip("\n").split("\n")
    summary = [item.partition("=") for item in lines[1].split()]
    out: Canonical = {"summary": [_row((k, "" if v == "-" else v) for k, _, v in summary)]}
    i = 2
    while i < len(lines):
        assert lines[i] == "", lines[i]
        name, header = lines[i + 1].rstrip(":"), lines[i + 2].split()
        assert set(lines[i + 3].replace(" ", "")) <= {"-"}, lines[i + 3]
        rows = []
        i += 4
        while i < len(lines) and lines[i] != "":
            cells = lines[i].split(None, len(header) - 1)
            cells += [""] * (len(header) - len(cells))
            rows.append(_row((k, "" if v == "-" else v) for k, v in zip(header, cells)))
            i += 1
        out[name] = rows
    return out


class _Html(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.out: Canonical = {}
        self._summary: list[tuple[str, str]] = []
        self._tag = ""
        self._text = ""
        self._section = ""
        self._header: list[str] = []
        self._cells: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._tag, self._text = tag, ""
        if tag == "tr":
            self._cells = []

    def handle_data(self, data: str) -> None:
        self._text += data

    def handle_endtag(self, tag: str) -> None:
        text = self._text
        self._text = ""
        if tag == "dt":
            self._summary.append((text, ""))
        elif tag == "dd":
            self._summary[-1] = (self._summary[-1][0], text)
        elif tag == "dl":
            self.out["summary"] = [_row(self._summary)]
        elif tag == "h2":
            self._section = text
            self._header = []
            self.out[text] = []
        elif tag in ("th", "td"):
            self._cells.append(text)
        elif tag == "tr" and self._section:
            if not self._header:
                self._header = self._cells
            else:
                self.out[self._section].append(_row(zip(self._header, self._cells)))


def from_html(text: str) -> Canonical:
    parser = _Html()
    parser.feed(text)
    return parser.out


def _without_empty(read: Callable[[str], Canonical]) -> Callable[[str], Canonical]:
    return lambda text: {name: rows for name, rows in read(text).items() if rows}


READERS = {fmt: _without_empty(read) for fmt, read in {"json": from_json, "csv": from_csv, "table": from_table, "html": from_html}.items()}


# ---- invoices: table, json, csv -------------------------------------------------------------------------

InvoiceRows = list[tuple[str, ...]]  # (label, gpu price, *amounts) per line, then ("total", "", *amounts, unpriced)


def invoice_from_json(text: str) -> InvoiceRows:
    document = json.loads(text)
    rows: InvoiceRows = []
    for line in document["lines"]:
        label = line["adapter"] if line["adjustment_for"] is None else f"{line['adapter']} (adjustment for {line['adjustment_for']})"
        amounts = [str(v) for k, v in line.items() if k not in ("adapter", "adjustment_for", "gpu_price_per_hour")]
        rows.append((label, line["gpu_price_per_hour"], *amounts))
    totals = document["totals"]
    rows.append(("total", "", *(str(v) for k, v in totals.items() if k != "unpriced_requests"), str(totals["unpriced_requests"])))
    return rows


def invoice_from_csv(text: str) -> InvoiceRows:
    rows: InvoiceRows = []
    for row in csv.DictReader(io.StringIO(text)):
        invoice_wide = ("tenant", "period", "status", "currency", "closed_at", "tiers_billed")  # on every row, not amounts
        keys = [k for k in row if k not in (*invoice_wide, "adapter", "adjustment_for", "gpu_price_per_hour", "unpriced_requests")]
        if row["adapter"] == "TOTAL":
            rows.append(("total", "", *(row[k] for k in keys), row["unpriced_requests"]))
        else:
            label = row["adapter"] if not row["adjustment_for"] else f"{row['adapter']} (adjustment for {row['adjustment_for']})"
            rows.append((label, row["gpu_price_per_hour"], *(row[k] for k in keys)))
    return rows


def invoice_from_table(text: str) -> InvoiceRows:
    """Columns cut where the rule line's dashes are (a label may hold spaces); the unpriced count from its note (0 without one)."""
    lines = text.rstrip("\n").split("\n")
    rule = lines[2]
    spans, start = [], 0
    for dashes in rule.split("  "):
        spans.append((start, start + len(dashes)))
        start += len(dashes) + 2
    body_end = lines.index(rule, 3)
    rows: InvoiceRows = [tuple(line[a:b].strip() for a, b in spans) for line in lines[3:body_end]]
    total = tuple(lines[body_end + 1][a:b].strip() for a, b in spans)
    unpriced = "0"
    for note in lines[body_end + 2:]:
        if note.startswith("note: ") and "succeeded requests earned nothing" in note:
            unpriced = note.split()[1]
    rows.append((*total, unpriced))
    return rows


INVOICE_READERS = {"json": invoice_from_json, "csv": invoice_from_csv, "table": invoice_from_table}
