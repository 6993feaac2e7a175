"""`lorabatch broker ...`: the embedded Kafka-protocol broker (Tansu), started in the background."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, settings_from

if TYPE_CHECKING:
    from consumer.broker import BrokerDaemon
    from consumer.config import Settings


def daemon(s: Settings, port: int | None) -> BrokerDaemon:
    """The background broker of `s`, on `port` when given."""
    from pathlib import Path

    from consumer.broker import BrokerDaemon

    return BrokerDaemon(Path(s.broker.state_dir), s.broker.host, port or s.broker.port)


# An option's range is checked by the command line: --port 70000 ended in the socket's OverflowError traceback, --port 0
# fell back to broker.port unsaid, and --partitions 0 was taken.
PortOpt = Annotated[Optional[int], typer.Option(min=1, max=65535, help="listen port (default: broker.port)")]


def start(config: ConfigOpt = None, port: PortOpt = None,
          partitions: Annotated[Optional[int], typer.Option(min=1, max=1024, help="partitions per topic (default: kafka.partitions)")] = None) -> None:
    """Start the broker in the background on 127.0.0.1 and create the topics."""
    from consumer.broker import BrokerError

    s = settings_from(config)
    d = daemon(s, port)
    k = s.kafka
    try:
        pid = d.start([k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], partitions or k.partitions, s.broker.start_timeout_s)
    except BrokerError as e:
        fail(str(e))
    typer.echo(f"broker running: pid {pid}, {d.host}:{d.port} (log {d.log_file})")


def stop(config: ConfigOpt = None, port: PortOpt = None) -> None:
    """Stop the background broker (its messages are in memory and go with it)."""
    d = daemon(settings_from(config), port)
    typer.echo("broker stopped" if d.stop() else f"no broker of ours runs on port {d.port}")


def status(config: ConfigOpt = None, port: PortOpt = None) -> None:
    """Say whether the broker runs and answers, and list its topics."""
    import asyncio

    d = daemon(settings_from(config), port)
    pid = d.pid()
    if pid is None:
        typer.echo(f"broker: not running (port {d.port})")
        raise typer.Exit(1)
    topics = asyncio.run(d.topics())
    typer.echo(f"broker: running, pid {pid}, {d.host}:{d.port}; topics: {', '.join(topics)}")


def register(app: typer.Typer) -> None:
    group = typer.Typer(help="The embedded Kafka-protocol broker (Tansu), for the demo and tests.", no_args_is_help=True)
    group.command("start")(start)
    group.command("stop")(stop)
    group.command("status")(status)
    app.add_typer(group, name="broker")
