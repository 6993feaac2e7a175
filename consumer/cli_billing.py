"""Billing commands: invoices (and, as the ledger grows, price lists and reports)."""

from __future__ import annotations

from typing import Annotated

import typer

from consumer.cli_common import ConfigOpt, _fail, _services, _settings


def register_billing(app: typer.Typer) -> None:
    app.command("invoice")(invoice)


def invoice(tenant: Annotated[str, typer.Option()], period: Annotated[str, typer.Option(help="YYYY-MM (UTC month)")],
            fmt: Annotated[str, typer.Option("--format", help="table, json or csv")] = "table",
            config: ConfigOpt = None) -> None:
    """A tenant's invoice for a month: per adapter, tokens, GPU milliseconds by component, cost."""
    from billing.errors import LedgerError
    from billing.invoice import build_invoice, render_csv, render_json, render_table

    renderers = {"table": render_table, "json": render_json, "csv": render_csv}
    if fmt not in renderers:
        _fail(f"--format {fmt!r}: use table, json or csv")
    s = _settings(config)
    svc = _services(s)
    try:
        inv = build_invoice(svc.db, tenant, period, s.ledger.gpu_price_per_hour, currency=s.ledger.currency)
    except LedgerError as e:
        _fail(str(e))
    typer.echo(renderers[fmt](inv))
