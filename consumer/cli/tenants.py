"""`lorabatch tenants ...`: tenants of the service, their rate limits and fair-share weights."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, open_ledger_db, open_services, print_table, settings_from


def add(tenant_id: str, config: ConfigOpt = None, name: Optional[str] = None, tier: str = "standard", weight: int = 1,
        rpm: Annotated[int, typer.Option(help="requests per minute; 0 is unlimited")] = 0,
        tpm: Annotated[int, typer.Option(help="tokens per minute; 0 is unlimited")] = 0) -> None:
    """Register a tenant."""
    from consumer.registry import RegistryError

    svc = open_services(settings_from(config))
    try:
        t = svc.registry.add_tenant(tenant_id, name, tier, weight, rpm, tpm)
    except RegistryError as e:
        fail(str(e))
    typer.echo(f"tenant {t.id} added (tier {t.tier}, weight {t.weight})")


def limits(tenant_id: str, config: ConfigOpt = None,
           rpm: Annotated[Optional[int], typer.Option(help="requests per minute; 0 is unlimited")] = None,
           tpm: Annotated[Optional[int], typer.Option(help="tokens per minute; 0 is unlimited")] = None,
           weight: Annotated[Optional[int], typer.Option(help="fair-share weight")] = None) -> None:
    """Change a tenant's rate limits or fair-share weight (running workers pick it up)."""
    from consumer.registry import RegistryError

    svc = open_services(settings_from(config))
    try:
        t = svc.registry.set_limits(tenant_id, rpm, tpm, weight)
    except RegistryError as e:
        fail(str(e))
    typer.echo(f"tenant {t.id}: weight {t.weight}, {t.requests_per_minute or 'unlimited'} requests/min, "
               f"{t.tokens_per_minute or 'unlimited'} tokens/min")


def list_(config: ConfigOpt = None) -> None:
    """List the tenants."""
    from rich.table import Table

    from consumer.tenants import list_tenants

    # Core, not the registry: the listing needs one select, and skipping the ORM halves the command's start.
    db = open_ledger_db(settings_from(config))
    try:
        tenants = list_tenants(db)
    finally:
        db.dispose()
    table = Table("tenant", "name", "tier", "weight")
    for t in tenants:
        table.add_row(t.id, t.display_name, t.tier, str(t.weight))
    print_table(table)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="Tenants of the service.", no_args_is_help=True)
    group.command("add")(add)
    group.command("limits")(limits)
    group.command("list")(list_)
    app.add_typer(group, name="tenants")
