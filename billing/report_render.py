"""The finance, SRE and reconciliation reports as a text table, JSON, CSV, or one self-contained HTML page with charts.

Every renderer works from the same three things: a title, a summary (name -> value) and the report's
tables (a name, a header and rows), so the four formats always carry the same figures. Decimals are
written as fixed-point text. The HTML page embeds its charts as base64 PNG data URLs and its style
inline: it loads nothing from anywhere and can be mailed or archived as one file.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal

from billing.finance import FinanceReport
from billing.cost import us_to_ms
from billing.invoice_render import csv_text, decimal_text, plain_text
from billing.reconcile import ReconcileReport, reconcile_summary
from billing.sre import PERCENTILES, SreReport

FORMATS = ("table", "json", "csv", "html")


@dataclass(frozen=True)
class Table:
    name: str
    header: tuple[str, ...]
    rows: tuple[tuple[object, ...], ...]


def _text(value: object) -> str:
    if isinstance(value, Decimal):
        return decimal_text(value)
    if isinstance(value, bool):
        return "yes" if value else ""
    return "" if value is None else str(value)


def _json_value(value: object) -> object:
    return decimal_text(value) if isinstance(value, Decimal) else value


Report = FinanceReport | SreReport | ReconcileReport


def _parts(report: Report) -> tuple[str, str, dict[str, object], list[Table]]:
    """(kind, title, summary, tables) of a report."""
    if isinstance(report, ReconcileReport):
        lines = Table("lines", ("item", "kind", "us", "ms", "note"),
                      tuple((line.item, line.kind, line.us, us_to_ms(line.us), line.note) for line in report.lines))
        return "reconcile", f"Reconciliation {report.period}", reconcile_summary(report), [lines]
    if isinstance(report, FinanceReport):
        summary = {"currency": report.currency, "flag_factor": report.flag_factor, "tenants": len(report.tenants), "requests": report.requests,
                   "gpu_ms": report.gpu_ms, "cost": report.cost, "revenue": report.revenue, "margin": report.margin,
                   "flagged": sum(t.flagged for t in report.tenants)}
        header = ("tenant", "tier", "status", "requests", "gpu_ms", "cost", "revenue", "margin", "gpu_share", "revenue_share", "flagged",
                  "unpriced_requests")
        rows = tuple((t.tenant, t.tier, t.status, t.requests, t.gpu_ms, t.cost, t.revenue, t.margin, t.gpu_share, t.revenue_share, t.flagged,
                      t.unpriced_requests) for t in report.tenants)
        return "finance", f"Finance report {report.period} ({report.currency})", summary, [Table("tenants", header, rows)]
    summary = {"adapters": len(report.adapters), "workers": len(report.workers), "busy_s": report.busy_s, "attributed_s": report.attributed_s,
               "unattributed_s": report.unattributed_s, "idle_s": report.idle_s, "unused_load_s": report.unused_load_s}
    latency = tuple(f"{kind}_p{p}_ms" for kind in ("total", "ttft") for p in PERCENTILES)
    adapters = Table(
        "adapters",
        ("adapter", "requests", "failed", "base_s", "lora_s", "routing_s", "kv_saved_s", "kv_measured_s", "cold_start_s", "gpu_s",
         "routing_overhead", "cached_tokens", "cold_starts", *latency),
        tuple((a.adapter, a.requests, a.failed, a.base_s, a.lora_s, a.routing_s, a.kv_saved_s, a.kv_measured_s, a.cold_start_s, a.gpu_s,
               a.routing_overhead, a.cached_tokens, a.cold_starts, *a.total_ms, *a.ttft_ms) for a in report.adapters),
    )
    workers = Table(
        "workers",
        ("worker", "gpu_kinds", "records", "steps", "busy_s", "span_s", "idle_s", "busy_share"),
        tuple((w.worker_id, w.gpu_kinds, w.records, w.steps, w.busy_s, w.span_s, w.idle_s, w.busy_share) for w in report.workers),
    )
    return "sre", f"SRE report {report.period}", summary, [adapters, workers]


def _cell(value: object) -> str:
    """A table cell: "-" where the other formats leave the value empty, so that every row has all its columns; a
    control character in a text (a newline in a tier's name) as its escape, so that a row stays one line."""
    return plain_text(_text(value)) or "-"


def _csv_cell(value: object) -> str:
    """A CSV cell: a text that a spreadsheet would run as a formula behind a "'" (billing/invoice_render.csv_text); a
    number as it is (a negative margin is a number, not a formula)."""
    return csv_text(value) if isinstance(value, str) else _text(value)


def render_report_table(report: Report) -> str:
    """Title, the summary as key=value, then each table aligned (text left, numbers right; the last column may hold spaces)."""
    _, title, summary, tables = _parts(report)
    out = [title, "  ".join(f"{key}={_cell(value)}" for key, value in summary.items())]
    for table in tables:
        cells = [table.header, *(tuple(map(_cell, row)) for row in table.rows)]
        widths = [max(len(row[i]) for row in cells) for i in range(len(table.header))]
        numeric = [i > 0 and all(isinstance(row[i], (int, Decimal)) and not isinstance(row[i], bool) for row in table.rows)
                   for i in range(len(table.header))]
        out += ["", f"{table.name}:"]
        for n, row in enumerate(cells):
            out.append("  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip())
            if n == 0:
                out.append("  ".join("-" * w for w in widths))
    return "\n".join(out) + "\n"


def render_report_json(report: Report) -> str:
    kind, _, summary, tables = _parts(report)
    document: dict[str, object] = {"report": kind, "period": report.period, "summary": {k: _json_value(v) for k, v in summary.items()}}
    for table in tables:
        document[table.name] = [{key: _json_value(value) for key, value in zip(table.header, row)} for row in table.rows]
    return json.dumps(document, indent=2)


def render_report_csv(report: Report) -> str:
    """One CSV: a `section` column names each row's table ("summary" for the first row, the summary's
    figures), the header is the union of the summary's keys and the tables' columns."""
    _, _, summary, tables = _parts(report)
    columns: list[str] = []
    for header in (tuple(summary), *(table.header for table in tables)):
        columns += [c for c in header if c not in columns]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["section", *columns])
    writer.writeheader()
    writer.writerow({"section": "summary", **{key: _csv_cell(value) for key, value in summary.items()}})
    for table in tables:
        for row in table.rows:
            writer.writerow({"section": table.name, **{key: _csv_cell(value) for key, value in zip(table.header, row)}})
    return out.getvalue()


_STYLE = """
body { font-family: sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
td.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.flagged { background: #fde2e1; }
figure { margin: 1.5em 0; }
dl { display: grid; grid-template-columns: max-content max-content; gap: 0.2em 1em; }
"""


def render_report_html(report: Report, charts: Sequence[tuple[str, bytes]]) -> str:
    """One self-contained HTML page: summary, charts (inline PNG data URLs) and every table."""
    _, title, summary, tables = _parts(report)
    e = html.escape
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{e(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(title)}</h1>",
        "<dl>" + "".join(f"<dt>{e(k)}</dt><dd>{e(_text(v))}</dd>" for k, v in summary.items()) + "</dl>",
    ]
    for chart_title, png in charts:
        data = base64.b64encode(png).decode("ascii")
        parts.append(f'<figure><img alt="{e(chart_title)}" src="data:image/png;base64,{data}"><figcaption>{e(chart_title)}</figcaption></figure>')
    for table in tables:
        flagged = table.header.index("flagged") if "flagged" in table.header else None
        parts.append(f"<h2>{e(table.name)}</h2><table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in table.header) + "</tr></thead><tbody>")
        for row in table.rows:
            css = ' class="flagged"' if flagged is not None and row[flagged] else ""
            cells = "".join(
                f'<td class="n">{e(_text(v))}</td>' if isinstance(v, (int, Decimal)) and not isinstance(v, bool) else f"<td>{e(_text(v))}</td>"
                for v in row
            )
            parts.append(f"<tr{css}>{cells}</tr>")
        parts.append("</tbody></table>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render_report(report: Report, fmt: str) -> str:
    """`report` in `fmt` (one of FORMATS); html draws the charts."""
    assert fmt in FORMATS, fmt
    if fmt == "html":
        from billing.charts import finance_charts, sre_charts

        if isinstance(report, ReconcileReport):
            return render_report_html(report, ())  # one table of signed figures: nothing a chart adds
        charts = finance_charts(report) if isinstance(report, FinanceReport) else sre_charts(report)
        return render_report_html(report, charts)
    return {"table": render_report_table, "json": render_report_json, "csv": render_report_csv}[fmt](report)
