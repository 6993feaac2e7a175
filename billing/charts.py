"""The reports' charts: matplotlib figures drawn off-screen (Agg) and returned as PNG bytes.

Figures are built with matplotlib.figure.Figure and an Agg canvas, never through pyplot, so no global
backend is chosen and nothing is left open. Values arrive as Decimals and are turned into floats here
and only here: a chart is a picture of the money, never a computation of it.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from decimal import Decimal

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from billing.finance import FinanceReport
from billing.sre import PERCENTILES, SreReport

MAX_BARS = 25  # beyond this a bar chart stops being readable; the tables hold every row
_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def _png(figure: Figure) -> bytes:
    FigureCanvasAgg(figure)
    out = io.BytesIO()
    figure.savefig(out, format="png", dpi=96, bbox_inches="tight")
    return out.getvalue()


def _floats(values: Sequence[Decimal]) -> list[float]:
    return [float(v) for v in values]


def _wrap(note: str) -> str:
    """A chart's note on a line of its own under its title."""
    return "\n" + note.strip(" ()") if note else ""


def _empty(title: str) -> bytes:
    figure = Figure(figsize=(6, 1.5))
    axes = figure.add_subplot()
    axes.axis("off")
    axes.text(0.5, 0.5, f"{title}: no data in this period", ha="center", va="center")
    return _png(figure)


def _most(rows: Sequence, key, what: str, by: str) -> tuple[list, str]:
    """The MAX_BARS rows of the largest `key`, and what a chart of them must say when that leaves rows out (a chart of
    the first 25 of 300 tenants, or of the 25 workers first by name of 80, was titled as if it showed them all)."""
    chosen = sorted(rows, key=key, reverse=True)[:MAX_BARS]
    if len(chosen) == len(rows):
        return chosen, ""
    return chosen, f" (the {len(chosen)} of {len(rows)} {what} with the most {by}; the table holds every one)"


def finance_charts(report: FinanceReport) -> list[tuple[str, bytes]]:
    """(title, PNG) pairs: GPU share against revenue share per tenant, and margin per tenant."""
    tenants, note = _most(report.tenants, lambda t: t.gpu_share, "tenants", "GPU time")
    if not tenants:
        return [("GPU share vs revenue share", _empty("GPU share vs revenue share"))]
    names = [t.tenant + (" (!)" if t.flagged else "") for t in tenants]
    positions = range(len(tenants))
    figure = Figure(figsize=(max(6, 0.6 * len(tenants) + 2), 4))
    axes = figure.add_subplot()
    axes.bar([p - 0.2 for p in positions], _floats([t.gpu_share * 100 for t in tenants]), 0.4, label="GPU time %", color=_COLORS[0])
    axes.bar([p + 0.2 for p in positions], _floats([t.revenue_share * 100 for t in tenants]), 0.4, label="revenue %", color=_COLORS[1])
    axes.set_xticks(list(positions), names, rotation=30, ha="right")
    axes.set_ylabel("share of the period, %")
    axes.set_title(f"{report.period}: GPU share vs revenue share ((!) flagged at x{report.flag_factor}){_wrap(note)}")
    axes.legend()
    shares = _png(figure)

    figure = Figure(figsize=(max(6, 0.6 * len(tenants) + 2), 4))
    axes = figure.add_subplot()
    margins = _floats([t.margin for t in tenants])
    axes.bar(list(positions), margins, color=[_COLORS[2] if m >= 0 else _COLORS[3] for m in margins])
    axes.axhline(0, color="black", linewidth=0.8)
    axes.set_xticks(list(positions), names, rotation=30, ha="right")
    axes.set_ylabel(f"margin, {report.currency}")
    axes.set_title(f"{report.period}: margin per tenant (revenue - GPU cost){_wrap(note)}")
    return [("GPU share vs revenue share" + note, shares), ("Margin per tenant" + note, _png(figure))]


def sre_charts(report: SreReport) -> list[tuple[str, bytes]]:
    """(title, PNG) pairs: GPU seconds by component per adapter, latency percentiles, busy and idle per worker."""
    charts = []
    adapters, note = _most(report.adapters, lambda a: a.gpu_s, "adapters", "GPU time")
    if adapters:
        figure = Figure(figsize=(8, max(3, 0.35 * len(adapters) + 1.5)))
        axes = figure.add_subplot()
        names = [a.adapter for a in adapters]
        left = [0.0] * len(adapters)
        for (label, values), color in zip(
            (("base", [a.base_s for a in adapters]), ("LoRA", [a.lora_s for a in adapters]), ("routing decision", [a.routing_s for a in adapters]),
             ("cold start", [a.cold_start_s for a in adapters])),
            _COLORS,
        ):
            widths = _floats(values)
            axes.barh(names, widths, left=left, label=label, color=color)
            left = [a + b for a, b in zip(left, widths)]
        axes.barh(names, _floats([-a.kv_saved_s for a in adapters]), label="KV credit", color=_COLORS[4])
        axes.axvline(0, color="black", linewidth=0.8)
        axes.invert_yaxis()
        axes.set_xlabel("GPU seconds")
        axes.set_title(f"{report.period}: GPU time by component per adapter{_wrap(note)}")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
        charts.append(("GPU time by component" + note, _png(figure)))

        figure = Figure(figsize=(8, max(3, 0.35 * len(adapters) + 1.5)))
        axes = figure.add_subplot()
        for i, (p, color) in enumerate(zip(PERCENTILES, _COLORS)):
            axes.barh([j + (i - 1) * 0.27 for j in range(len(adapters))], _floats([a.total_ms[i] for a in adapters]), 0.27, label=f"p{p}", color=color)
        axes.set_yticks(range(len(adapters)), names)
        axes.invert_yaxis()
        axes.set_xlabel("total latency, ms")
        axes.set_title(f"{report.period}: latency percentiles per adapter{_wrap(note)}")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
        charts.append(("Latency percentiles" + note, _png(figure)))
    else:
        charts.append(("GPU time by component", _empty("GPU time by component")))
    workers, note = _most(report.workers, lambda w: w.idle_s, "workers", "idle time")
    if workers:
        figure = Figure(figsize=(8, max(2.5, 0.35 * len(workers) + 1.5)))
        axes = figure.add_subplot()
        names = [w.worker_id for w in workers]
        busy = _floats([w.busy_s for w in workers])
        axes.barh(names, busy, label="busy", color=_COLORS[0])
        axes.barh(names, _floats([w.idle_s for w in workers]), left=busy, label="idle (unattributed)", color="#BBBBBB")
        axes.invert_yaxis()
        axes.set_xlabel("seconds of wall time")
        axes.set_title(f"{report.period}: GPU busy and idle per worker{_wrap(note)}")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
        charts.append(("GPU busy and idle" + note, _png(figure)))
    return charts
