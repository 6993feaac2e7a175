"""Billing commands: invoices (draft, close), price lists, and the finance, SRE and reconciliation reports."""

from __future__ import annotations

import re
from datetime import date
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Annotated, Optional

import typer

from consumer.cli_common import ConfigOpt, _fail, _services, _settings

prices_app = typer.Typer(help="Price lists with effective dates: GPU hours (cost) and tier tokens (revenue).", no_args_is_help=True)
report_app = typer.Typer(help="Reports over a billing period: finance, SRE and reconciliation.", no_args_is_help=True)

PeriodOpt = Annotated[str, typer.Option("--period", help="YYYY-MM (a UTC month)")]
FromOpt = Annotated[str, typer.Option("--from", help="first day it applies, YYYY-MM-DD (from midnight UTC)")]
OutOpt = Annotated[Optional[Path], typer.Option("-o", "--output", help="write here instead of stdout")]
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def register_billing(app: typer.Typer) -> None:
    app.command("invoice")(invoice)
    app.add_typer(prices_app, name="prices")
    app.add_typer(report_app, name="report")


def _decimal(option: str, text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        _fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    if not value.is_finite():
        _fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    return value


def _day(text: str) -> date:
    try:
        if not _DAY.fullmatch(text):
            raise ValueError(text)
        return date.fromisoformat(text)
    except ValueError:
        _fail(f"--from {text!r} is not a day; write it as YYYY-MM-DD, e.g. 2026-10-01")


def _write(text: str, output: Path | None) -> None:
    if output is None:
        typer.echo(text, nl=False)
    else:
        output.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {output}", err=True)


def invoice(
    tenant: Annotated[Optional[str], typer.Option(help="the tenant whose invoice to show (or close)")] = None,
    period: Annotated[Optional[str], typer.Option(help="YYYY-MM (a UTC month)")] = None,
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
    from billing.invoice_render import render_csv, render_json, render_table

    renderers = {"table": render_table, "json": render_json, "csv": render_csv}
    if fmt not in renderers:
        _fail(f"--format {fmt!r}: use table, json or csv")
    if close_period is None and (tenant is None or period is None):
        _fail("pass --tenant T --period YYYY-MM (add --close to close it), or --close-period YYYY-MM")
    if close_period is not None and (close or period is not None):
        _fail("--close-period closes a whole month by itself; leave out --period and --close")
    s = _settings(config)
    svc = _services(s)
    try:
        if close_period is not None:
            invoices = close_month(svc.db, s.ledger, close_period)
            invoices = [i for i in invoices if tenant is None or i.tenant == tenant]
        elif close:
            invoices = [close_invoice(svc.db, s.ledger, tenant, period)]  # type: ignore[arg-type]
        else:
            invoices = [build_invoice(svc.db, tenant, period, s.ledger)]  # type: ignore[arg-type]
    except LedgerError as e:
        _fail(str(e))
    finally:
        svc.close()
    if fmt == "json" and close_period is not None:
        typer.echo("[" + ",\n".join(render_json(i) for i in invoices) + "]")
    elif fmt == "csv" and len(invoices) > 1:
        typer.echo(renderers["csv"](invoices[0]) + "".join(renderers["csv"](i).split("\n", 1)[1] for i in invoices[1:]), nl=False)
    else:
        typer.echo("\n".join(renderers[fmt](i) for i in invoices), nl=fmt == "json")
    if close_period is not None:
        typer.echo(f"period {close_period} closed: {len(invoices)} invoices frozen", err=True)


@prices_app.command("set-gpu")
def prices_set_gpu(kind: Annotated[str, typer.Argument(help="GPU kind, as in ledger.gpu_kind")],
                   price: Annotated[str, typer.Argument(help="price of one GPU hour")],
                   effective_from: FromOpt, config: ConfigOpt = None) -> None:
    """Set the price of one hour of a GPU kind from a day on (replacing an entry of that day)."""
    from billing.errors import LedgerError
    from billing.prices import set_gpu_price

    s = _settings(config)
    value, day = _decimal("PRICE", price), _day(effective_from)
    svc = _services(s)
    try:
        entry = set_gpu_price(svc.db, kind, value, day)
    except LedgerError as e:
        _fail(str(e))
    finally:
        svc.close()
    typer.echo(f"gpu {entry.gpu_kind}: {entry.price_per_hour} {s.ledger.currency} per hour from {day.isoformat()} (UTC)")


@prices_app.command("set-tokens")
def prices_set_tokens(tier: Annotated[str, typer.Argument(help="tenant tier, as in `lorabatch tenants add --tier`")],
                      input_price: Annotated[str, typer.Option("--input", help="price per million input tokens")],
                      output_price: Annotated[str, typer.Option("--output", help="price per million output tokens")],
                      effective_from: FromOpt, config: ConfigOpt = None) -> None:
    """Set a tier's prices per million input and output tokens from a day on (replacing an entry of that day)."""
    from billing.errors import LedgerError
    from billing.prices import set_token_price

    s = _settings(config)
    inp, out, day = _decimal("--input", input_price), _decimal("--output", output_price), _day(effective_from)
    svc = _services(s)
    try:
        entry = set_token_price(svc.db, tier, inp, out, day)
    except LedgerError as e:
        _fail(str(e))
    finally:
        svc.close()
    typer.echo(f"tier {entry.tier}: {entry.input_per_million} input / {entry.output_per_million} output {s.ledger.currency} "
               f"per million tokens from {day.isoformat()} (UTC)")


@prices_app.command("list")
def prices_list(fmt: Annotated[str, typer.Option("--format", help="table or json")] = "table", config: ConfigOpt = None) -> None:
    """List every price-list entry; the GPU kind this deployment bills at, and its fallback price."""
    import json

    from sqlalchemy.orm import Session

    from billing.invoice_render import price_text
    from billing.prices import gpu_price_list, token_price_list

    if fmt not in ("table", "json"):
        _fail(f"--format {fmt!r}: use table or json")
    s = _settings(config)
    svc = _services(s)
    try:
        with Session(svc.db) as session:
            gpu, tokens = gpu_price_list(session), token_price_list(session)
    finally:
        svc.close()
    if fmt == "json":
        typer.echo(json.dumps({
            "currency": s.ledger.currency, "gpu_kind": s.ledger.gpu_kind, "fallback_gpu_price_per_hour": price_text(s.ledger.gpu_price_per_hour),
            "gpu": [{"gpu_kind": g.gpu_kind, "from": g.effective_from.date().isoformat(), "price_per_hour": price_text(g.price_per_hour)} for g in gpu],
            "tokens": [{"tier": t.tier, "from": t.effective_from.date().isoformat(), "input_per_million": price_text(t.input_per_million),
                        "output_per_million": price_text(t.output_per_million)} for t in tokens],
        }, indent=2))
        return
    typer.echo(f"GPU prices per hour ({s.ledger.currency}); this deployment bills gpu_kind {s.ledger.gpu_kind!r}, "
               f"at {price_text(s.ledger.gpu_price_per_hour)} where no entry applies")
    for g in gpu:
        typer.echo(f"  {g.gpu_kind:<20} from {g.effective_from:%Y-%m-%d}  {price_text(g.price_per_hour):>14}")
    typer.echo(f"Token prices per million ({s.ledger.currency}): input / output")
    for t in tokens:
        typer.echo(f"  {t.tier:<20} from {t.effective_from:%Y-%m-%d}  {price_text(t.input_per_million):>14} / {price_text(t.output_per_million)}")
    if not tokens:
        typer.echo("  (none: invoices earn no revenue until a tier has one; `lorabatch prices set-tokens TIER --input P --output P --from DAY`)")


def _report(kind: str, period: str, fmt: str, output: Path | None, config: Path | None, flag_factor: str | None = None) -> None:
    from billing.errors import LedgerError
    from billing.finance import finance_report
    from billing.reconcile import reconcile_report
    from billing.report_render import FORMATS, render_report
    from billing.sre import sre_report

    if fmt not in FORMATS:
        _fail(f"--format {fmt!r}: use {', '.join(FORMATS)}")
    s = _settings(config)
    factor = None
    if flag_factor is not None:
        factor = _decimal("--flag-factor", flag_factor)
        if factor <= 0:
            _fail(f"--flag-factor {flag_factor}: pass a factor above 0, e.g. 1.5")
    svc = _services(s)
    try:
        if kind == "finance":
            report = finance_report(svc.db, period, s.ledger, factor)
        elif kind == "sre":
            report = sre_report(svc.db, period)
        else:
            report = reconcile_report(svc.db, period, s.ledger)
    except LedgerError as e:
        _fail(str(e))
    finally:
        svc.close()
    _write(render_report(report, fmt), output)


@report_app.command("finance")
def report_finance(period: PeriodOpt, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
                   output: OutOpt = None,
                   flag_factor: Annotated[Optional[str], typer.Option("--flag-factor", help="flag a tenant whose GPU share exceeds its revenue share by this factor (default: ledger.finance_flag_factor)")] = None,
                   config: ConfigOpt = None) -> None:
    """Per tenant: revenue, GPU cost, margin, GPU share against revenue share, flags."""
    _report("finance", period, fmt, output, config, flag_factor)


@report_app.command("sre")
def report_sre(period: PeriodOpt, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
               output: OutOpt = None, config: ConfigOpt = None) -> None:
    """Per adapter: GPU time by component, routing overhead, KV savings, cold starts, latency; GPU idle per worker."""
    _report("sre", period, fmt, output, config)


@report_app.command("reconcile")
def report_reconcile(period: PeriodOpt, fmt: Annotated[str, typer.Option("--format", help="table, json, csv or html")] = "table",
                     output: OutOpt = None, config: ConfigOpt = None) -> None:
    """Measured GPU busy and load time against what the invoices attribute; every residue named (idle, redelivered work, ...)."""
    _report("reconcile", period, fmt, output, config)
