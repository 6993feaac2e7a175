"""`lorabatch db ...`: the ledger database schema (Alembic)."""

from __future__ import annotations

from typing import Annotated

import typer

from consumer.cli.common import ConfigOpt, settings_from


def upgrade(
    revision: Annotated[str, typer.Argument(help="the revision to migrate to (default: head, the newest)")] = "head",
    config: ConfigOpt = None,
    revision_opt: Annotated[str | None, typer.Option("--revision", help="the same as REVISION (older spelling)")] = None,
) -> None:
    """Migrate the ledger database to REVISION (default: the newest)."""
    if revision_opt is not None:
        if revision not in ("head", revision_opt):
            raise typer.BadParameter(f"REVISION {revision!r} and --revision {revision_opt!r} differ; give one")
        revision = revision_opt
    from billing.db import upgrade as migrate_up
    from consumer.services import shown_url
    from migrations import SCRIPT_LOCATION

    s = settings_from(config)
    migrate_up(s.ledger.url, revision, script_location=SCRIPT_LOCATION)
    typer.echo(f"ledger at {shown_url(s.ledger.url)}: upgraded to {revision}")


def downgrade(revision: str, config: ConfigOpt = None) -> None:
    """Migrate the ledger database down to REVISION ("base" drops every table). What the later revisions added, columns
    and tables, goes with the data in them; an upgrade adds them back empty."""
    from billing.db import downgrade as migrate_down
    from consumer.services import shown_url
    from migrations import SCRIPT_LOCATION

    s = settings_from(config)
    typer.echo(f"downgrading the ledger at {shown_url(s.ledger.url)} to {revision}: the columns and tables of the later "
               "revisions are dropped with their data (an upgrade adds them back empty)", err=True)
    migrate_down(s.ledger.url, revision, script_location=SCRIPT_LOCATION)
    typer.echo(f"ledger at {shown_url(s.ledger.url)}: downgraded to {revision}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The ledger database schema (Alembic).", no_args_is_help=True)
    group.command("upgrade")(upgrade)
    group.command("downgrade")(downgrade)
    app.add_typer(group, name="db")
