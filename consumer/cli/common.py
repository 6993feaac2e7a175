"""What every `lorabatch` command shares: settings, errors, progress bars, tables, services, the ledger database.

Cheap to import (typer and rich's console only): `lorabatch --help` and the admin commands load the
configuration, the database layer or the engine only inside the commands that use them.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from rich.progress import Progress
    from sqlalchemy import Engine as SqlEngine

    from consumer.config import Settings
    from consumer.services import Services

console = Console(stderr=True)
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config file (default: $LORABATCH_CONFIG or ./lorabatch.toml)")]


def settings_from(config: Path | None, **overrides) -> Settings:
    """The settings from `config` (or its default lookup), with the non-None `overrides` ("section.key": value)."""
    from consumer.config import ConfigError, load_settings

    try:
        return load_settings(config, {k: v for k, v in overrides.items() if v is not None})
    except ConfigError as e:
        fail(str(e))


def fail(message: str, code: int = 2) -> NoReturn:
    """Print `message` as one error line on stderr (never wrapped) and exit with `code`; under --debug, the
    traceback of the error being handled first."""
    if _DEBUG["on"] and sys.exc_info()[1] is not None:
        import traceback

        traceback.print_exc()
    console.print(f"[red]error:[/red] {escape(one_line(message))}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def one_line(text: str) -> str:
    """`text` with its line breaks and runs of blanks as single spaces."""
    return " ".join(str(text).split())


def setup_logging(level: str = "INFO") -> None:
    """JSON log lines on stderr, for the processes that run (consumer.logs)."""
    from consumer.logs import json_logging

    json_logging(level)


# ---- operational errors: one line and exit status 2, no traceback (`lorabatch --debug` shows it) ----------------

_DEBUG = {"on": False}  # set by the --debug option before the command runs


def set_debug(on: bool) -> None:
    """The --debug option: tracebacks of operational errors, and every library's log."""
    _DEBUG["on"] = on
    if on:
        from consumer.logs import command_logging

        command_logging(True)


def _brief(e: BaseException, limit: int = 400) -> str:
    text = one_line(str(e)) or type(e).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def operational_message(e: BaseException) -> str | None:
    """What failed and the fix, in one line, for an operational failure; None for a programmer's mistake.

    Operational: the project's typed errors (they carry `retriable` and say the fix), Kafka, the ledger
    database, Redis, files and connections. The libraries are looked up among the loaded modules only: an
    error of one that was never imported cannot have been raised.
    """
    kafka = sys.modules.get("aiokafka.errors")
    if kafka is not None and isinstance(e, kafka.KafkaError):
        return (f"the Kafka broker failed ({_brief(e)}); start it with `lorabatch broker start`, "
                f"or set kafka.bootstrap_servers to a running one, then run the command again")
    sa = sys.modules.get("sqlalchemy.exc")
    if sa is not None:
        if isinstance(e, (sa.OperationalError, sa.InterfaceError)) and _login_refused(getattr(e, "orig", None) or e):
            return (f"the ledger database refused the login ({_brief(getattr(e, 'orig', None) or e)}); set the user and "
                    f"password in ledger.url (postgresql+psycopg://USER:PASSWORD@HOST:PORT/DB), then run the command again")
        if isinstance(e, (sa.OperationalError, sa.InterfaceError)) and re.search(r'database "[^"]*" does not exist',
                                                                                  str(getattr(e, "orig", None) or e)):
            return (f"the ledger database does not exist ({_brief(getattr(e, 'orig', None) or e)}); create it "
                    f"(`createdb NAME`, then `lorabatch db upgrade`), or set ledger.url to one that exists")
        if isinstance(e, sa.DBAPIError) and (said := _sqlite_fault(getattr(e, "orig", None))) is not None:
            return said
        if isinstance(e, (sa.OperationalError, sa.InterfaceError)):
            return (f"the ledger database cannot be reached ({_brief(getattr(e, 'orig', None) or e)}); start it, "
                    f"or set ledger.url to a running one, then run the command again")
        if isinstance(e, (sa.ArgumentError, sa.NoSuchModuleError)):
            return (f"ledger.url is not a usable database URL ({_brief(e)}); write it as sqlite:///PATH or "
                    f"postgresql+psycopg://USER@HOST:PORT/DB")
        if isinstance(e, sa.DBAPIError):
            return (f"the ledger database refused a statement ({_brief(getattr(e, 'orig', None) or e)}); if its schema "
                    f"is behind, run `lorabatch db upgrade`")
    redis = sys.modules.get("redis.exceptions")
    if redis is not None and (isinstance(e, (redis.AuthenticationError, redis.AuthorizationError))
                              or isinstance(e, redis.ResponseError) and _login_refused(e)):
        return (f"Redis refused the login ({_brief(e)}); set the password (and user) in routing.redis_url, as "
                f"redis://:PASSWORD@HOST:PORT/DB or redis://USER:PASSWORD@HOST:PORT/DB, then run the command again")
    if redis is not None and isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
        return (f"Redis cannot be reached ({_brief(e)}); start it, or set routing.redis_url to a running one "
                f"(or routing.cache = \"lru\"), then run the command again")
    engine_api = sys.modules.get("engine.api")
    if engine_api is not None and isinstance(e, engine_api.EngineError) and e.code.startswith("model_"):
        return (f"{_brief(e)}; set engine.model_dir (or --model) to a Hugging Face model folder, or write the demo "
                f"one with `lorabatch make-demo-model DIR`")
    if isinstance(getattr(type(e), "retriable", None), bool):  # the project's typed errors say their fix, last: cut
        return _brief(e, 2000)  # at 400 characters, a long path named twice (a spool file's) cut off the fix
    if isinstance(e, ConnectionError):
        return f"a connection failed ({_brief(e)}); check that the service at the configured address is running"
    if isinstance(e, OSError):
        what = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else _brief(e)
        return f"{what}; check the path and its permissions"
    return None


def _sqlite_fault(e: BaseException | None) -> str | None:
    """What a SQLite ledger's own error means, and the fix. sqlite3 raises OperationalError for a read-only file, a full
    disk, a lock held past the busy timeout and a missing table alike, and each was said as "the ledger database cannot
    be reached (attempt to write a readonly database); start it, or set ledger.url to a running one": a file has nothing
    to start."""
    sqlite3 = sys.modules.get("sqlite3")
    if sqlite3 is None or not isinstance(e, sqlite3.Error):
        return None
    text = str(e).lower()
    if "readonly" in text or "read-only" in text:
        fix = "give the user running lorabatch write access to the ledger file and its folder (SQLite writes beside it)"
    elif "disk is full" in text or "disk i/o" in text:
        fix = "free space on the ledger file's disk (or check the disk), then run the command again"
    elif "locked" in text or "busy" in text:
        fix = "another process held its write lock past the busy timeout (a `db upgrade`, a long close); run the command again once it ends"
    elif "not a database" in text or "malformed" in text:  # `db upgrade` fails on it the same way
        fix = ("the file ledger.url names is not a SQLite database, or a damaged one; set ledger.url to the ledger's "
               "file, or restore the ledger from a backup")
    elif "unable to open" in text:
        fix = "check that ledger.url names a file in a folder this user can read and write"
    else:
        fix = "if its schema is behind or was changed by hand, run `lorabatch db upgrade`"
    return f"the SQLite ledger database failed a statement ({_brief(e)}); {fix}"


def _login_refused(e: BaseException) -> bool:
    """Whether a database's or Redis's error says it refused the credentials (not that it could not be reached)."""
    text = str(e).lower()
    return bool(re.search(r'role "[^"]*" does not exist', text)) or any(w in text for w in ("password authentication failed", "no password supplied", "wrongpass", "noauth",
                                   "invalid password", "invalid username-password", "authentication required"))


def run(app: typer.Typer) -> None:
    """Run the `lorabatch` command: an operational error is one line on stderr and exit status 2."""
    import traceback

    from consumer.logs import command_logging

    command_logging()
    try:
        app()
    except KeyboardInterrupt:
        console.print("interrupted", highlight=False)
        sys.exit(130)
    except Exception as e:
        from consumer.logs import json_active

        message = operational_message(e)
        if json_active():  # a process that logs JSON lines (the worker) ends with one as well
            log = logging.getLogger("lorabatch")
            if message is None:
                log.critical("stopped by an unexpected error: %s: %s", type(e).__name__, e, exc_info=True)
                sys.exit(1)
            log.error(one_line(message), exc_info=_DEBUG["on"])
            sys.exit(2)
        if message is None:
            raise  # a programmer's mistake: the traceback is the report
        if _DEBUG["on"]:
            traceback.print_exc()
        console.print(f"[red]error:[/red] {escape(one_line(message))}", highlight=False, soft_wrap=True)
        sys.exit(2)


def progress_bar(unit: str = "items") -> Progress:
    """A progress bar on stderr: of items done out of a total, or (`unit="bytes"`) of a file read, with the `sent` and
    `rejected` counts its task carries."""
    from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if unit == "bytes":
        return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TextColumn("{task.fields[sent]} sent, {task.fields[rejected]} rejected"), TimeElapsedColumn(), console=console)
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


@contextmanager
def working(description: str) -> Iterator[None]:
    """A spinner with the time elapsed on stderr while a long read runs (a report over a million-row month took 9 to 27 s
    with nothing on the screen); on a terminal only, and gone once it ends, so stdout and files carry only the output."""
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        bar.add_task(description, total=None)
        yield


def open_services(s: Settings) -> Services:
    """Database, registry and ledger for `s`; a ledger without the current schema ends the command with a fix."""
    from consumer.services import SchemaMissing
    from consumer.services import open_services as open_all

    try:
        return open_all(s)
    except SchemaMissing as e:
        fail(str(e))


def open_ledger_db(s: Settings) -> SqlEngine:
    """The ledger database alone, for commands that read it through SQLAlchemy Core (no ORM, no registry)."""
    from consumer.services import SchemaMissing
    from consumer.services import open_ledger_db as open_db

    try:
        return open_db(s)
    except SchemaMissing as e:
        fail(str(e))


def current_month() -> str:
    """This UTC month as YYYY-MM: the period of `invoice` and `report` when none is given."""
    from datetime import UTC, datetime

    return datetime.now(UTC).strftime("%Y-%m")


def print_table(table) -> None:
    """A rich table on stdout; piped or captured output gets room enough not to cut cells. Cells are plain text: a
    tenant's display name or an adapter's name such as "[/x]" is printed as written, never read as rich markup (which
    raised MarkupError and ended the command)."""
    Console(width=None if sys.stdout.isatty() else 200, markup=False).print(table)


def parse_decimal(option: str, text: str) -> Decimal:
    """`text` as a finite Decimal, or the command ends naming `option`."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    if not value.is_finite():
        fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    return value
