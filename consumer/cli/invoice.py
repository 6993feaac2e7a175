"""`lorabatch invoice`: a tenant's invoice for a month (a draft until closed), or closing one or a whole month."""

from __future__ import annotations

from datetime import datetime, timezone

from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, current_month, fail, open_services, settings_from, working


def invoice(
    tenant: Annotated[Optional[str], typer.Option(help="the tenant whose invoice to show (or close)")] = None,
    period: Annotated[Optional[str], typer.Option(help="YYYY-MM (a UTC month; default: this month)")] = None,
    close: Annotated[bool, typer.Option("--close", help="close (freeze) the tenant's invoice of the period")] = False,
    close_period: Annotated[Optional[str], typer.Option("--close-period", help="close every tenant's invoice of this YYYY-MM")] = None,
    fmt: Annotated[str, typer.Option("--format", help="table, json or csv")] = "table",
    config: ConfigOpt = None,
) -> None:
    """A tenant's invoice for a month (a draft until closed), or close one invoice or a whole month.

    Closing freezes the invoice: its lines and totals are stored and never change. Usage that arrives
    later for a closed month is billed in the tenant's next open month, as adjustment lines.
    """
    from billing.closing import close_invoice
    from billing.closing import close_period as close_month
    from billing.errors import LedgerError
    from billing.invoice import build_invoice
    from billing.invoice_render import csv_header, render_csv, render_json, render_table

    renderers = {"table": render_table, "json": render_json, "csv": render_csv}
    if fmt not in renderers:
        fail(f"--format {fmt!r}: use table, json or csv")
    if close_period is None and tenant is None:
        fail("pass --tenant T [--period YYYY-MM, default this month] (add --close to close it), or --close-period YYYY-MM")
    if close_period is not None and (close or period is not None):
        fail("--close-period closes a whole month by itself; leave out --period and --close")
    if close_period is not None and tenant is not None:
        # Refused, not filtered: closing is for good, and it would freeze every tenant's invoice while showing one.
        fail(f"--close-period closes every tenant's invoice of {close_period}; to close only {tenant!r}'s, pass "
             f"--tenant {tenant} --period {close_period} --close")  # fmt: skip
    if close and period is None:
        fail("--close freezes an invoice for good: name its month with --period YYYY-MM")
    period = current_month() if period is None else period  # `--period ""` is refused below, not this month
    started = datetime.now(timezone.utc)
    s = settings_from(config)
    svc = open_services(s)
    try:
        with working(f"closing {close_period}" if close_period is not None else f"reading {tenant}'s invoice of {period}"):
            if close_period is not None:
                invoices = close_month(svc.db, s.ledger, close_period)
            elif close:
                invoices = [close_invoice(svc.db, s.ledger, tenant, period)]  # type: ignore[arg-type]
            else:
                invoices = [build_invoice(svc.db, tenant, period, s.ledger)]  # type: ignore[arg-type]
    except LedgerError as e:
        fail(str(e))
    finally:
        svc.close()
    if fmt == "json" and close_period is not None:
        typer.echo("[" + ",\n".join(render_json(i) for i in invoices) + "]")
    elif fmt == "csv" and not invoices:  # a month with nothing to close: its columns still, for whatever reads them
        typer.echo(csv_header(), nl=False)
    elif fmt == "csv" and len(invoices) > 1:
        typer.echo(renderers["csv"](invoices[0]) + "".join(renderers["csv"](i).split("\n", 1)[1] for i in invoices[1:]), nl=False)
    else:
        typer.echo("\n".join(renderers[fmt](i) for i in invoices), nl=fmt == "json")
    if close_period is not None:
        typer.echo(_closed_line(close_period, invoices, started), err=True)


def _closed_line(period: str, invoices: list, started: datetime) -> str:
    """What `--close-period` did: the invoices it froze now, and those closed before it (a second close changes nothing)."""
    def utc(at: datetime) -> datetime:
        return at if at.utcoffset() is not None else at.replace(tzinfo=timezone.utc)  # SQLite hands back naive UTC

    before = [i for i in invoices if i.closed_at is not None and utc(i.closed_at) < started]
    now = len(invoices) - len(before)
    if not before:
        return f"period {period} closed: {now} invoices frozen"
    earliest = min(utc(i.closed_at) for i in before)
    return f"period {period} closed: {now} invoices frozen now, {len(before)} closed before (from {earliest:%Y-%m-%dT%H:%M:%SZ})"


def register(app: typer.Typer) -> None:
    app.command("invoice")(invoice)
