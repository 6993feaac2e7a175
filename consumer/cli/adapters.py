"""`lorabatch adapters ...`: LoRA adapters in the registry (stored by content) and their traffic split."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, open_services, print_table, settings_from


def add(name: str, directory: Path, tenant: Annotated[str, typer.Option(help="owner tenant")],
        default: Annotated[bool, typer.Option("--default", help="the tenant's default adapter")] = False,
        public: Annotated[bool, typer.Option("--public", help="usable by every tenant")] = False,
        canary: Annotated[Optional[int], typer.Option(help="a new version takes only this percentage of the traffic")] = None,
        config: ConfigOpt = None) -> None:
    """Store a PEFT adapter folder by content and register it as NAME for a tenant."""
    from consumer.registry import RegistryError
    from engine.api import AdapterError

    svc = open_services(settings_from(config))
    try:
        a, created = svc.registry.add_adapter(tenant, name, directory, default=default, public=public, canary=canary)
    except (RegistryError, AdapterError) as e:
        fail(str(e))
    what = "registered" if created else "unchanged (same content)"
    typer.echo(f"adapter {tenant}/{a.adapter} {what}: rank {a.rank}, {', '.join(a.target_modules)}, sha256 {a.sha256[:12]}")


def traffic(name: str, weights: Annotated[list[str], typer.Argument(help="VERSION=WEIGHT pairs, e.g. 1=90 2=10")],
            tenant: Annotated[str, typer.Option(help="owner tenant")], config: ConfigOpt = None) -> None:
    """Split an adapter name's traffic among its versions (canary, promote, roll back)."""
    from consumer.registry import RegistryError

    parsed = {}
    for w in weights:
        v, sep, weight = w.partition("=")
        if not sep or not v.isdigit() or not weight.isdigit():
            fail(f"{w!r}: write VERSION=WEIGHT, e.g. 2=10")
        parsed[int(v)] = int(weight)
    svc = open_services(settings_from(config))
    try:
        views = svc.registry.set_traffic(tenant, name, parsed)
    except RegistryError as e:
        fail(str(e))
    total = sum(v.traffic_weight for v in views)
    typer.echo(", ".join(f"{v.adapter}: {100 * v.traffic_weight / total:.0f}%" for v in views))


def list_(config: ConfigOpt = None, tenant: Optional[str] = None) -> None:
    """List the registered adapters."""
    from rich.table import Table

    svc = open_services(settings_from(config))
    table = Table("tenant", "adapter", "rank", "targets", "public", "default", "traffic", "sha256")
    for a in svc.registry.list_adapters(tenant):
        table.add_row(a.tenant_id, a.adapter, str(a.rank), ",".join(a.target_modules), "yes" if a.is_public else "",
                      "yes" if a.is_default else "", str(a.traffic_weight), a.sha256[:12])
    print_table(table)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="LoRA adapters in the registry.", no_args_is_help=True)
    group.command("add")(add)
    group.command("traffic")(traffic)
    group.command("list")(list_)
    app.add_typer(group, name="adapters")
