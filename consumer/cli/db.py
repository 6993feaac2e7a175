"""`lorabatch db ...`: the ledger database schema (Alembic)."""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from consumer.cli.common import ConfigOpt, fail, settings_from


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
    before = _check_known(s.ledger.url)
    _check_revision(revision, SCRIPT_LOCATION)
    _migrate(migrate_up, s.ledger.url, revision, SCRIPT_LOCATION, before, currency=s.ledger.currency)
    typer.echo(f"ledger at {shown_url(s.ledger.url)}: upgraded to {revision}")


def downgrade(revision: str, config: ConfigOpt = None) -> None:
    """Migrate the ledger database down to REVISION ("base" drops every table). What the later revisions added, columns
    and tables, goes with the data in them; an upgrade adds them back empty."""
    from billing.db import downgrade as migrate_down
    from consumer.services import shown_url
    from migrations import SCRIPT_LOCATION

    s = settings_from(config)
    before = _check_known(s.ledger.url)
    _check_revision(revision, SCRIPT_LOCATION)  # before the warning: a revision that does not exist drops nothing
    typer.echo(f"downgrading the ledger at {shown_url(s.ledger.url)} to {revision}: the columns and tables of the later "
               "revisions are dropped with their data (an upgrade adds them back empty)", err=True)
    _migrate(migrate_down, s.ledger.url, revision, SCRIPT_LOCATION, before)
    typer.echo(f"ledger at {shown_url(s.ledger.url)}: downgraded to {revision}")


def _check_known(url: str) -> str | None:
    """The ledger's revision (None: no schema); the command ends if it is one this code has no script of (a newer
    lorabatch migrated it): Alembic cannot move it up or down from there, and said so only as a traceback."""
    from billing.db import current_revision, known_revisions, make_engine
    from consumer.services import schema_mismatch, shown_url
    from migrations import SCRIPT_LOCATION

    db = make_engine(url)
    try:
        found = current_revision(db)
    finally:
        db.dispose()
    if found is not None and found not in known_revisions(SCRIPT_LOCATION):
        fail(schema_mismatch(shown_url(url), found))
    return found


def _revision_error(revision: str, e: Exception, script_location: str, at: str = "") -> NoReturn:
    from billing.db import known_revisions

    known = known_revisions(script_location)
    fail(f"REVISION {revision!r}: {e}{at}; give one of {', '.join(known)} ({known[-1]} is the newest, also `head`; "
         f"`base` is before the first), or a step such as +1 (down one: `-- -1`)")


def _check_revision(revision: str, script_location: str) -> None:
    """End the command naming the valid revisions if `revision`, a name (a step such as +1 resolves only against the
    ledger, in the migration), is no revision of the scripts (Alembic's CommandError was a traceback)."""
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    if "+" in revision or "-" in revision:
        return
    try:
        ScriptDirectory(script_location).get_revisions(revision)
    except CommandError as e:
        _revision_error(revision, e, script_location)


def _migrate(migrate, url: str, revision: str, script_location: str, before: str | None, **options: str) -> None:
    """`migrate` (billing.db's upgrade or downgrade) from the ledger's revision `before` to `revision`; a revision
    Alembic cannot resolve or reach from the ledger's (a step past either end, a downgrade "to" a later one) ends the
    command naming the valid ones, and Ctrl-C ends it saying where the schema was left (it exited 130 silently)."""
    from alembic.util import CommandError

    from billing.db import current_revision, make_engine

    try:
        migrate(url, revision, script_location=script_location, **options)
    except KeyboardInterrupt:
        _interrupted(migrate.__name__, url, before)
    except CommandError as e:
        db = make_engine(url)
        try:
            found = current_revision(db)
        finally:
            db.dispose()
        _revision_error(revision, e, script_location, f" (the ledger is at {found or 'base, no schema'})")


def _interrupted(command: str, url: str, before: str | None) -> NoReturn:
    """End an interrupted `db upgrade` or `db downgrade` saying where the schema is. Either runs as one transaction
    (migrations/env.py: an explicit BEGIN on SQLite; on PostgreSQL Alembic's one transaction for the whole run, not one
    per revision), so an interrupted one is rolled back whole; the revision is read again to say so, since a Ctrl-C
    that lands after the commit finds the ledger moved."""
    from billing.db import current_revision, make_engine
    from consumer.services import shown_url

    db = make_engine(url)
    try:
        after = current_revision(db)
    finally:
        db.dispose()
    at = after or "base, no schema"
    if after != before:
        fail(f"db {command} interrupted after it was committed: the ledger at {shown_url(url)} is at {at}", 130)
    fail(f"db {command} interrupted: the ledger at {shown_url(url)} was left unchanged, at {at} (the {command} runs as "
         f"one transaction, rolled back whole); run the command again", 130)


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The ledger database schema (Alembic).", no_args_is_help=True)
    group.command("upgrade")(upgrade)
    group.command("downgrade")(downgrade)
    app.add_typer(group, name="db")
