"""What every `lorabatch` command shares: settings, errors, progress bars, tables, services, the ledger database.

Cheap to import (typer and rich's console only): `lorabatch --help` and the admin commands load the
configuration, the database layer or the engine only inside the commands that use them.
"""

from __future__ import annotations

import logging
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NoReturn, Optional

import typer
from rich.console import Console

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
    """Print `message` as an error on stderr and exit with `code`."""
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":%(message)r}')
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def progress_bar() -> Progress:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


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


def print_table(table) -> None:
    """A rich table on stdout; piped or captured output gets room enough not to cut cells."""
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def parse_decimal(option: str, text: str) -> Decimal:
    """`text` as a finite Decimal, or the command ends naming `option`."""
    try:
        value = Decimal(text)
    except InvalidOperation:
        fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    if not value.is_finite():
        fail(f"{option} {text!r} is not a number; write it as a decimal such as 2.50")
    return value
