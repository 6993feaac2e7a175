"""`lorabatch demo`: the whole service end to end on embedded defaults (consumer.demo does the work)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from consumer.cli.common import console


def demo(jobs: Annotated[int, typer.Option(min=1, help="jobs to submit")] = 200,
         port: Annotated[Optional[int], typer.Option(min=1, max=65535, help="broker port (default: a free one)")] = None,
         home: Annotated[Path, typer.Option(help="where the demo keeps its model, ledger and store")] = Path(".lorabatch/demo")) -> None:
    """The whole service end to end on embedded defaults: broker, worker, ~200 jobs, invoices."""
    import sys

    from consumer.demo import run_demo

    sys.exit(run_demo(home, jobs, port, console))


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
