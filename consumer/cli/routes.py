"""`lorabatch routes ...`: L3 routing rules (keyword, regex or prefix -> adapter), per tenant."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, open_services, print_table, settings_from


def add(pattern: str, adapter: str, tenant: Annotated[str, typer.Option(help="the tenant whose jobs it routes")],
        kind: Annotated[str, typer.Option(help="keyword, regex or prefix")] = "keyword",
        position: Annotated[int, typer.Option(help="rules match in ascending position")] = 0,
        config: ConfigOpt = None) -> None:
    """Route a tenant's jobs whose prompt matches PATTERN to ADAPTER (name or name@version)."""
    from consumer.registry import RegistryError
    from consumer.rules import RuleError

    svc = open_services(settings_from(config))
    try:
        rule = svc.registry.add_rule(tenant, kind, pattern, adapter, position)
    except (RegistryError, RuleError) as e:
        fail(str(e))
    typer.echo(f"rule {rule.id} added: {tenant} {kind} {pattern!r} -> {adapter}")


def list_(config: ConfigOpt = None, tenant: Optional[str] = None) -> None:
    """List the routing rules in match order."""
    from rich.table import Table

    svc = open_services(settings_from(config))
    table = Table("id", "tenant", "position", "kind", "pattern", "adapter")
    for r in svc.registry.list_rules(tenant):
        table.add_row(str(r.id), r.tenant_id, str(r.position), r.kind, r.pattern, r.adapter)
    print_table(table)


def remove(rule_id: int, config: ConfigOpt = None) -> None:
    """Remove a routing rule by id."""
    from consumer.registry import RegistryError

    svc = open_services(settings_from(config))
    try:
        svc.registry.remove_rule(rule_id)
    except RegistryError as e:
        fail(str(e))
    typer.echo(f"rule {rule_id} removed")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="L3 routing rules: keyword, regex or prefix -> adapter, per tenant.", no_args_is_help=True)
    group.command("add")(add)
    group.command("list")(list_)
    group.command("remove")(remove)
    app.add_typer(group, name="routes")
