"""`lorabatch config ...`: the effective configuration."""

from __future__ import annotations

import typer

from consumer.cli.common import ConfigOpt, settings_from


def show(config: ConfigOpt = None) -> None:
    """Print the effective configuration as TOML."""
    typer.echo(settings_from(config).to_toml())


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The configuration.", no_args_is_help=True)
    group.command("show")(show)
    app.add_typer(group, name="config")
