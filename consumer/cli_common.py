"""What every `lorabatch` command shares: settings, errors, progress bars, services."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from consumer.config import ConfigError, Settings, load_settings

console = Console(stderr=True)
ConfigOpt = Annotated[Optional[Path], typer.Option("--config", "-c", help="TOML config file (default: $LORABATCH_CONFIG or ./lorabatch.toml)")]


def _settings(config: Path | None, **overrides) -> Settings:
    try:
        return load_settings(config, {k: v for k, v in overrides.items() if v is not None})
    except ConfigError as e:
        _fail(str(e))


def _fail(message: str, code: int = 2) -> NoReturn:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format='{"ts":"%(asctime)s","level":"%(levelname)s","logger":"%(name)s","msg":%(message)r}')
    logging.getLogger("aiokafka").setLevel(logging.WARNING)


def progress_bar() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console)


def _services(s: Settings):
    from consumer.services import SchemaMissing, open_services

    try:
        return open_services(s)
    except SchemaMissing as e:
        _fail(str(e))




def print_table(table) -> None:
    """A rich table on stdout; piped or captured output gets room enough not to cut cells."""
    Console(width=None if sys.stdout.isatty() else 200).print(table)
