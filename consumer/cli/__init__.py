"""`lorabatch`: the one command that fronts the service.

One module per command group; each has `register(app)`, and `build_app()` mounts them all when the
command runs (nothing is mounted at import). A module imports only typer and `consumer.cli.common` at
its top: the configuration, the database layer, Kafka and the engine (torch) load inside the commands
that use them, so `lorabatch --help` and the admin commands start fast.
"""

from __future__ import annotations

import typer


def build_app() -> typer.Typer:
    """The `lorabatch` command with every command group registered."""
    from consumer.cli import (
        adapters, batches, bench, broker, config, db, demo, invoice, offline, prices, reports, routes, tenants, worker,
    )

    from consumer.cli.common import set_debug

    app = typer.Typer(help="Multi-tenant LoRA batch inference fed by Kafka, with an exact GPU cost ledger.",
                      no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)

    @app.callback()
    def options(debug: bool = typer.Option(False, "--debug", help="show the traceback of an error, and every library's log")) -> None:
        """Multi-tenant LoRA batch inference fed by Kafka, with an exact GPU cost ledger.

        An operational error (a broker or database that cannot be reached, a missing model or config file)
        is one line on stderr saying what failed and the fix, with exit status 2.
        """
        set_debug(debug)

    # Commands, then groups, in the order `lorabatch --help` lists them.
    for module in (offline, worker, batches, demo, invoice, broker, db, tenants, adapters, config, routes, bench, prices, reports):
        module.register(app)
    return app


def main() -> None:
    from consumer.cli.common import run

    run(build_app())
