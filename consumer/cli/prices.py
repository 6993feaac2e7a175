"""`lorabatch prices ...`: price lists with effective dates, GPU hours (cost) and tier tokens (revenue)."""

from __future__ import annotations

import re
from datetime import date, datetime
from typing import Annotated

import typer

from consumer.cli.common import ConfigOpt, fail, open_services, parse_decimal, settings_from

FromOpt = Annotated[str, typer.Option("--from", help="first day it applies, YYYY-MM-DD (from midnight UTC)")]
_DAY = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")


def parse_day(text: str) -> date:
    """`text` as a YYYY-MM-DD day, or the command ends naming --from."""
    try:
        if not _DAY.fullmatch(text):
            raise ValueError(text)
        return date.fromisoformat(text)
    except ValueError:
        fail(f"--from {text!r} is not a day; write it as YYYY-MM-DD, e.g. 2026-10-01")


def _stops(at: datetime | None) -> str:
    if at is None:
        return ""
    return (f" to {at.date().isoformat()}, where {at:%Y-%m} is closed: the price in effect there before was set again from that day, "
            f"so its prices stay final")


def set_gpu(kind: Annotated[str, typer.Argument(help="GPU kind, as in ledger.gpu_kind")],
            price: Annotated[str, typer.Argument(help="price of one GPU hour")],
            effective_from: FromOpt, config: ConfigOpt = None) -> None:
    """Set the price of one hour of a GPU kind from a day on (replacing an entry of that day)."""
    from billing.errors import LedgerError
    from billing.prices import set_gpu_price

    s = settings_from(config)
    value, day = parse_decimal("PRICE", price), parse_day(effective_from)
    svc = open_services(s)
    try:
        entry = set_gpu_price(svc.db, kind, value, day, currency=s.ledger.currency,
                              fallback=(s.ledger.gpu_kind, s.ledger.gpu_price_per_hour))
    except LedgerError as e:
        fail(str(e))
    finally:
        svc.close()
    typer.echo(f"gpu {entry.gpu_kind}: {entry.price_per_hour} {s.ledger.currency} per hour from {day.isoformat()} (UTC)"
               f"{_stops(entry.stops_at)}")


def set_tokens(tier: Annotated[str, typer.Argument(help="tenant tier, as in `lorabatch tenants add --tier`")],
               input_price: Annotated[str, typer.Option("--input", help="price per million input tokens")],
               output_price: Annotated[str, typer.Option("--output", help="price per million output tokens")],
               effective_from: FromOpt, config: ConfigOpt = None) -> None:
    """Set a tier's prices per million input and output tokens from a day on (replacing an entry of that day)."""
    from billing.errors import LedgerError
    from billing.prices import set_token_price

    s = settings_from(config)
    inp, out, day = parse_decimal("--input", input_price), parse_decimal("--output", output_price), parse_day(effective_from)
    svc = open_services(s)
    try:
        entry = set_token_price(svc.db, tier, inp, out, day, currency=s.ledger.currency)
    except LedgerError as e:
        fail(str(e))
    finally:
        svc.close()
    typer.echo(f"tier {entry.tier}: {entry.input_per_million} input / {entry.output_per_million} output {s.ledger.currency} "
               f"per million tokens from {day.isoformat()} (UTC){_stops(entry.stops_at)}")


def list_(fmt: Annotated[str, typer.Option("--format", help="table or json")] = "table", config: ConfigOpt = None) -> None:
    """List every price-list entry; the GPU kind the fallback price is for, and that price."""
    import json

    from sqlalchemy.orm import Session

    from billing.invoice_render import price_text
    from billing.prices import gpu_price_list, token_price_list

    if fmt not in ("table", "json"):
        fail(f"--format {fmt!r}: use table or json")
    s = settings_from(config)
    svc = open_services(s)
    try:
        with Session(svc.db) as session:
            gpu, tokens = gpu_price_list(session), token_price_list(session)
    finally:
        svc.close()
    if fmt == "json":
        typer.echo(json.dumps({
            "currency": s.ledger.currency, "gpu_kind": s.ledger.gpu_kind, "fallback_gpu_price_per_hour": price_text(s.ledger.gpu_price_per_hour),
            "gpu": [{"gpu_kind": g.gpu_kind, "from": g.effective_from.date().isoformat(), "price_per_hour": price_text(g.price_per_hour),
                     "currency": g.currency} for g in gpu],
            "tokens": [{"tier": t.tier, "from": t.effective_from.date().isoformat(), "input_per_million": price_text(t.input_per_million),
                        "output_per_million": price_text(t.output_per_million), "currency": t.currency} for t in tokens],
        }, indent=2))
        return
    typer.echo(f"GPU prices per hour, each in the currency it was set in (invoices are in ledger.currency {s.ledger.currency} and "
               f"price only with entries in it); usage is billed at the list of the gpu_kind that ran it; "
               f"gpu_kind {s.ledger.gpu_kind!r} (and usage recorded before kinds were) at {price_text(s.ledger.gpu_price_per_hour)} "
               f"{s.ledger.currency} where no entry applies, any other kind not at all")
    for g in gpu:
        typer.echo(f"  {g.gpu_kind:<20} from {g.effective_from.date().isoformat()}  {price_text(g.price_per_hour):>14} {g.currency}")
    typer.echo("Token prices per million: input / output")
    for t in tokens:
        typer.echo(f"  {t.tier:<20} from {t.effective_from.date().isoformat()}  {price_text(t.input_per_million):>14} / "
                   f"{price_text(t.output_per_million)} {t.currency}")
    if not tokens:
        typer.echo("  (none: invoices earn no revenue until a tier has one; `lorabatch prices set-tokens TIER --input P --output P --from DAY`)")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Price lists with effective dates: GPU hours (cost) and tier tokens (revenue).", no_args_is_help=True)
    group.command("set-gpu")(set_gpu)
    group.command("set-tokens")(set_tokens)
    group.command("list")(list_)
    app.add_typer(group, name="prices")
