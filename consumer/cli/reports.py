"""`lorabatch report ...`: reports over a billing period (finance, SRE, reconciliation) in four formats."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from consumer.cli.batches import replacing, writable
from consumer.cli.common import ConfigOpt, current_month, fail, open_services, parse_decimal, settings_from, working

PeriodOpt = Annotated[Optional[str], typer.Option("--period", help="YYYY-MM (a UTC month; default: this month)")]
OutOpt = Annotated[Optional[Path], typer.Option("-o", "--output", help="write here instead of stdout")]


def write_out(text: str, output: Path | None, stream: int | None) -> None:
    """`text` on stdout, or into `output` with a note on stderr: a file written beside and moved over it, so a write
    that fails (a full disk) leaves the file there as it was; a stream (`writable`) written to directly."""
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        with open(stream, "w", encoding="utf-8") if stream is not None else replacing(output) as out:
            out.write(text)
    except OSError as e:
        kept = "" if stream is not None else " (the file there is as it was)"
        fail(f"cannot write -o {output}: {e.strerror or e}; the report was not written{kept}: free space there, or "
             f"give another path")
    typer.echo(f"wrote {output}", err=True)


def run_report(kind: str, period: str | None, fmt: str, output: Path | None, config: Path | None, flag_factor: str | None = None) -> None:
    """Build the `kind` report of `period` (this UTC month when None) and write it in `fmt`."""
    from billing.config import MAX_FLAG_FACTOR
    from billing.errors import LedgerError
    from billing.finance import finance_report
    from billing.reconcile import reconcile_report
    from billing.report_render import FORMATS, render_report
    from billing.sre import sre_report

    if fmt not in FORMATS:
        fail(f"--format {fmt!r}: use {', '.join(FORMATS)}")
    period = current_month() if period is None else period  # `--period ""` is refused below, not this month
    s = settings_from(config)
    stream = writable(output) if output is not None else None  # before the ledger is read, not after it
    factor = None
    if flag_factor is not None:
        factor = parse_decimal("--flag-factor", flag_factor)
        if not 0 < factor <= MAX_FLAG_FACTOR:
            fail(f"--flag-factor {flag_factor}: pass a factor above 0 and at most {MAX_FLAG_FACTOR}, e.g. 1.5")
    svc = open_services(s)
    try:
        with working(f"reading the ledger for the {kind} report of {period}"):
            if kind == "finance":
                report = finance_report(svc.db, period, s.ledger, factor)
            elif kind == "sre":
                report = sre_report(svc.db, period)
            else:
                report = reconcile_report(svc.db, period, s.ledger)
    except LedgerError as e:
        fail(str(e))
    finally:
        svc.close()
    write_out(render_report(report, fmt), output, stream)


def finance(period: PeriodOpt = None, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
            output: OutOpt = None,
            flag_factor: Annotated[Optional[str], typer.Option("--flag-factor", help="flag a tenant whose GPU share exceeds its revenue share by this factor (default: ledger.finance_flag_factor)")] = None,
            config: ConfigOpt = None) -> None:
    """Per tenant: revenue, GPU cost, margin, GPU share against revenue share, flags."""
    run_report("finance", period, fmt, output, config, flag_factor)


def sre(period: PeriodOpt = None, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
        output: OutOpt = None, config: ConfigOpt = None) -> None:
    """Per adapter: GPU time by component, routing overhead, KV savings, cold starts, latency; GPU idle per worker."""
    run_report("sre", period, fmt, output, config)


def reconcile(period: PeriodOpt = None, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
              output: OutOpt = None, config: ConfigOpt = None) -> None:
    """Measured GPU busy and load time against what the invoices attribute; every residue named (idle, redelivered work, ...)."""
    run_report("reconcile", period, fmt, output, config)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Reports over a billing period: finance, SRE and reconciliation.", no_args_is_help=True)
    group.command("finance")(finance)
    group.command("sre")(sre)
    group.command("reconcile")(reconcile)
    app.add_typer(group, name="report")
