"""`lorabatch worker`: one worker process (one per GPU); SIGTERM drains and exits."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, open_services, settings_from, setup_logging


def worker(config: ConfigOpt = None, log_level: str = "INFO",
           worker_id: Annotated[Optional[str], typer.Option(help="stable id: the static group member name and ledger worker")] = None,
           metrics_port: Annotated[Optional[int], typer.Option(help="serve Prometheus /metrics on this port")] = None) -> None:
    """Consume jobs, run them on the engine, publish results, bill them, commit. SIGTERM drains and exits."""
    import asyncio
    import logging
    import signal

    from consumer.worker import Worker
    from engine.engine import Engine

    setup_logging(log_level)
    s = settings_from(config, **{"worker.worker_id": worker_id, "worker.metrics_port": metrics_port})
    svc = open_services(s)
    engine = Engine(s.engine)
    w = Worker(s, engine, svc.registry, svc.ledger)
    if s.worker.metrics_port:
        w.metrics.serve(s.worker.metrics_port)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.stop)
        await w.run()

    logging.getLogger("lorabatch.worker").info("worker %s starting on %s", w.worker_id, s.kafka.bootstrap_servers)
    asyncio.run(main())
    svc.close()


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
