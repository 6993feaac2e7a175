"""`lorabatch config ...`: the effective configuration."""

from __future__ import annotations

from typing import Annotated

import typer

from consumer.cli.common import ConfigOpt, settings_from


def show(config: ConfigOpt = None,
         sizes: Annotated[bool, typer.Option("--sizes/--no-sizes", help="also the engine's sizes derived from this machine's device")] = True,
         show_passwords: Annotated[bool, typer.Option("--show-passwords", help="print the passwords in ledger.url and routing.redis_url (masked *** by default)")] = False) -> None:  # fmt: skip
    """Print the effective configuration as TOML, then, as comments, the engine sizes it gets on this machine's device and
    where each comes from (on a GPU, those the configuration leaves unset are derived from the device's memory and the
    model). Passwords inside the database and Redis URLs are masked unless --show-passwords."""
    settings = settings_from(config)
    typer.echo(settings.to_toml(mask_passwords=not show_passwords))
    if not sizes:
        return
    from engine.api import EngineError
    from engine.sizing import plan

    try:
        device, lines = plan(settings.engine)
    except (EngineError, OSError) as e:
        typer.echo(f"# engine sizes: not derived ({e})")
        return
    # As TOML comments, so that the whole output stays a valid configuration file.
    width = max(len(d.field) + len(str(d.value)) for d in lines) + 3
    typer.echo(f"# engine sizes on {device} (what the engine takes at start; set a field above to fix it):")
    for d in lines:
        typer.echo(f"#   {f'{d.field} = {d.value}':<{width}}  <- {d.source}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The configuration.", no_args_is_help=True)
    group.command("show")(show)
    app.add_typer(group, name="config")
