"""`lorabatch`: the one command that fronts the service."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from consumer.cli_common import ConfigOpt, _fail, _services, _settings, _setup_logging, console, print_table, progress_bar
from consumer.config import Settings

app = typer.Typer(help="Multi-tenant LoRA batch inference fed by Kafka, with an exact GPU cost ledger.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
broker_app = typer.Typer(help="The embedded Kafka-protocol broker (Tansu), for the demo and tests.", no_args_is_help=True)
db_app = typer.Typer(help="The ledger database schema (Alembic).", no_args_is_help=True)
tenants_app = typer.Typer(help="Tenants of the service.", no_args_is_help=True)
adapters_app = typer.Typer(help="LoRA adapters in the registry.", no_args_is_help=True)
config_app = typer.Typer(help="The configuration.", no_args_is_help=True)
routes_app = typer.Typer(help="L3 routing rules: keyword, regex or prefix -> adapter, per tenant.", no_args_is_help=True)
for sub, name in ((broker_app, "broker"), (db_app, "db"), (tenants_app, "tenants"), (adapters_app, "adapters"),
                  (config_app, "config"), (routes_app, "routes")):
    app.add_typer(sub, name=name)

# ------------------------------------------------------------------------- config


@config_app.command("show")
def config_show(config: ConfigOpt = None) -> None:
    """Print the effective configuration as TOML."""
    typer.echo(_settings(config).to_toml())


# ------------------------------------------------------------------------- broker


def _daemon(s: Settings, port: int | None):
    from consumer.broker import BrokerDaemon

    return BrokerDaemon(Path(s.broker.state_dir), s.broker.host, port or s.broker.port)


@broker_app.command("start")
def broker_start(config: ConfigOpt = None, port: Annotated[Optional[int], typer.Option(help="listen port")] = None,
                 partitions: Annotated[Optional[int], typer.Option(help="partitions per topic")] = None) -> None:
    """Start the broker in the background on 127.0.0.1 and create the topics."""
    from consumer.broker import BrokerError

    s = _settings(config)
    d = _daemon(s, port)
    k = s.kafka
    try:
        pid = d.start([k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], partitions or k.partitions, s.broker.start_timeout_s)
    except BrokerError as e:
        _fail(str(e))
    typer.echo(f"broker running: pid {pid}, {d.host}:{d.port} (log {d.log_file})")


@broker_app.command("stop")
def broker_stop(config: ConfigOpt = None, port: Annotated[Optional[int], typer.Option()] = None) -> None:
    """Stop the background broker (its messages are in memory and go with it)."""
    d = _daemon(_settings(config), port)
    typer.echo("broker stopped" if d.stop() else f"no broker of ours runs on port {d.port}")


@broker_app.command("status")
def broker_status(config: ConfigOpt = None, port: Annotated[Optional[int], typer.Option()] = None) -> None:
    """Say whether the broker runs and answers, and list its topics."""
    d = _daemon(_settings(config), port)
    pid = d.pid()
    if pid is None:
        typer.echo(f"broker: not running (port {d.port})")
        raise typer.Exit(1)
    topics = asyncio.run(d.topics())
    typer.echo(f"broker: running, pid {pid}, {d.host}:{d.port}; topics: {', '.join(topics)}")


# ------------------------------------------------------------------------- model, database, registry


@app.command("make-demo-model")
def make_demo_model(out_dir: Path, seed: int = 0) -> None:
    """Write a tiny random-weight Llama (HF format) and 8 PEFT adapters of mixed ranks under OUT_DIR."""
    from engine.demo_model import write_demo_set

    paths = write_demo_set(out_dir, seed=seed)
    typer.echo(f"model: {out_dir / 'model'}")
    for name, p in paths.items():
        typer.echo(f"adapter {name}: {p}")


@db_app.command("upgrade")
def db_upgrade(config: ConfigOpt = None, revision: str = "head") -> None:
    """Migrate the ledger database to REVISION (default: the newest)."""
    from billing.db import upgrade

    s = _settings(config)
    upgrade(s.ledger.url, revision)
    typer.echo(f"ledger at {s.ledger.url}: upgraded to {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str, config: ConfigOpt = None) -> None:
    """Migrate the ledger database down to REVISION ("base" drops every table)."""
    from billing.db import downgrade

    s = _settings(config)
    downgrade(s.ledger.url, revision)
    typer.echo(f"ledger at {s.ledger.url}: downgraded to {revision}")


@tenants_app.command("add")
def tenants_add(tenant_id: str, config: ConfigOpt = None, name: Optional[str] = None, tier: str = "standard", weight: int = 1,
                rpm: Annotated[int, typer.Option(help="requests per minute; 0 is unlimited")] = 0,
                tpm: Annotated[int, typer.Option(help="tokens per minute; 0 is unlimited")] = 0) -> None:
    """Register a tenant."""
    from consumer.registry import RegistryError

    svc = _services(_settings(config))
    try:
        t = svc.registry.add_tenant(tenant_id, name, tier, weight, rpm, tpm)
    except RegistryError as e:
        _fail(str(e))
    typer.echo(f"tenant {t.id} added (tier {t.tier}, weight {t.weight})")


@tenants_app.command("limits")
def tenants_limits(tenant_id: str, config: ConfigOpt = None,
                   rpm: Annotated[Optional[int], typer.Option(help="requests per minute; 0 is unlimited")] = None,
                   tpm: Annotated[Optional[int], typer.Option(help="tokens per minute; 0 is unlimited")] = None,
                   weight: Annotated[Optional[int], typer.Option(help="fair-share weight")] = None) -> None:
    """Change a tenant's rate limits or fair-share weight (running workers pick it up)."""
    from consumer.registry import RegistryError

    svc = _services(_settings(config))
    try:
        t = svc.registry.set_limits(tenant_id, rpm, tpm, weight)
    except RegistryError as e:
        _fail(str(e))
    typer.echo(f"tenant {t.id}: weight {t.weight}, {t.requests_per_minute or 'unlimited'} requests/min, "
               f"{t.tokens_per_minute or 'unlimited'} tokens/min")


@tenants_app.command("list")
def tenants_list(config: ConfigOpt = None) -> None:
    """List the tenants."""
    svc = _services(_settings(config))
    table = Table("tenant", "name", "tier", "weight")
    for t in svc.registry.list_tenants():
        table.add_row(t.id, t.display_name, t.tier, str(t.weight))
    print_table(table)


@adapters_app.command("add")
def adapters_add(name: str, directory: Path, tenant: Annotated[str, typer.Option(help="owner tenant")],
                 default: Annotated[bool, typer.Option("--default", help="the tenant's default adapter")] = False,
                 public: Annotated[bool, typer.Option("--public", help="usable by every tenant")] = False,
                 canary: Annotated[Optional[int], typer.Option(help="a new version takes only this percentage of the traffic")] = None,
                 config: ConfigOpt = None) -> None:
    """Store a PEFT adapter folder by content and register it as NAME for a tenant."""
    from consumer.registry import RegistryError
    from engine.api import AdapterError

    svc = _services(_settings(config))
    try:
        a, created = svc.registry.add_adapter(tenant, name, directory, default=default, public=public, canary=canary)
    except (RegistryError, AdapterError) as e:
        _fail(str(e))
    what = "registered" if created else "unchanged (same content)"
    typer.echo(f"adapter {tenant}/{a.ref} {what}: rank {a.rank}, {', '.join(a.target_modules)}, sha256 {a.sha256[:12]}")


@adapters_app.command("traffic")
def adapters_traffic(name: str, weights: Annotated[list[str], typer.Argument(help="VERSION=WEIGHT pairs, e.g. 1=90 2=10")],
                     tenant: Annotated[str, typer.Option(help="owner tenant")], config: ConfigOpt = None) -> None:
    """Split an adapter name's traffic among its versions (canary, promote, roll back)."""
    from consumer.registry import RegistryError

    parsed = {}
    for w in weights:
        v, sep, weight = w.partition("=")
        if not sep or not v.isdigit() or not weight.isdigit():
            _fail(f"{w!r}: write VERSION=WEIGHT, e.g. 2=10")
        parsed[int(v)] = int(weight)
    svc = _services(_settings(config))
    try:
        views = svc.registry.set_traffic(tenant, name, parsed)
    except RegistryError as e:
        _fail(str(e))
    total = sum(v.traffic_weight for v in views)
    typer.echo(", ".join(f"{v.ref}: {100 * v.traffic_weight / total:.0f}%" for v in views))


@adapters_app.command("list")
def adapters_list(config: ConfigOpt = None, tenant: Optional[str] = None) -> None:
    """List the registered adapters."""
    svc = _services(_settings(config))
    table = Table("tenant", "adapter", "rank", "targets", "public", "default", "traffic", "sha256")
    for a in svc.registry.list_adapters(tenant):
        table.add_row(a.tenant_id, a.ref, str(a.rank), ",".join(a.target_modules), "yes" if a.is_public else "",
                      "yes" if a.is_default else "", str(a.traffic_weight), a.sha256[:12])
    print_table(table)


@routes_app.command("add")
def routes_add(pattern: str, adapter: str, tenant: Annotated[str, typer.Option(help="the tenant whose jobs it routes")],
               kind: Annotated[str, typer.Option(help="keyword, regex or prefix")] = "keyword",
               position: Annotated[int, typer.Option(help="rules match in ascending position")] = 0,
               config: ConfigOpt = None) -> None:
    """Route a tenant's jobs whose prompt matches PATTERN to ADAPTER (name or name@version)."""
    from consumer.registry import RegistryError
    from consumer.rules import RuleError

    svc = _services(_settings(config))
    try:
        rule = svc.registry.add_rule(tenant, kind, pattern, adapter, position)
    except (RegistryError, RuleError) as e:
        _fail(str(e))
    typer.echo(f"rule {rule.id} added: {tenant} {kind} {pattern!r} -> {adapter}")


@routes_app.command("list")
def routes_list(config: ConfigOpt = None, tenant: Optional[str] = None) -> None:
    """List the routing rules in match order."""
    svc = _services(_settings(config))
    table = Table("id", "tenant", "position", "kind", "pattern", "adapter")
    for r in svc.registry.list_rules(tenant):
        table.add_row(str(r.id), r.tenant_id, str(r.position), r.kind, r.pattern, r.adapter)
    print_table(table)


@routes_app.command("remove")
def routes_remove(rule_id: int, config: ConfigOpt = None) -> None:
    """Remove a routing rule by id."""
    from consumer.registry import RegistryError

    svc = _services(_settings(config))
    try:
        svc.registry.remove_rule(rule_id)
    except RegistryError as e:
        _fail(str(e))
    typer.echo(f"rule {rule_id} removed")


# ------------------------------------------------------------------------- offline generation


@app.command("generate")
def generate(jobs: Annotated[Path, typer.Option("--jobs", help="JSONL of jobs (prompt or input_ids)")],
             model: Annotated[Optional[Path], typer.Option("--model", help="HF model folder")] = None,
             adapter: Annotated[Optional[list[str]], typer.Option("--adapter", help="NAME=DIR, repeatable")] = None,
             config: ConfigOpt = None) -> None:
    """Run a JSONL batch on the engine offline (no Kafka); one result line per job, in input order."""
    from consumer.offline import run_offline

    s = _settings(config, **({"engine.model_dir": str(model)} if model else {}))
    adapters = {}
    for spec in adapter or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            _fail(f"--adapter {spec!r}: write it as NAME=DIR")
        adapters[name] = Path(path)
    try:
        for line in run_offline(s.engine, adapters, jobs):
            typer.echo(line)
    except FileNotFoundError as e:
        _fail(str(e))


# ------------------------------------------------------------------------- worker


@app.command("worker")
def worker(config: ConfigOpt = None, log_level: str = "INFO",
           worker_id: Annotated[Optional[str], typer.Option(help="stable id: the static group member name and ledger worker")] = None,
           metrics_port: Annotated[Optional[int], typer.Option(help="serve Prometheus /metrics on this port")] = None) -> None:
    """Consume jobs, run them on the engine, publish results, bill them, commit. SIGTERM drains and exits."""
    from consumer.worker import Worker
    from engine.engine import Engine

    _setup_logging(log_level)
    s = _settings(config, **{"worker.worker_id": worker_id, "worker.metrics_port": metrics_port})
    svc = _services(s)
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


# ------------------------------------------------------------------------- submit and results


def _broker_failed(s: Settings, e: Exception, again: str = "run the command again") -> str:
    return (f"the broker at {s.kafka.bootstrap_servers} failed: {e!r}; start it with `lorabatch broker start` "
            f"or set kafka.bootstrap_servers to a running one, then {again}")


@app.command("submit")
def submit(file: Path, tenant: Annotated[str, typer.Option(help="tenant the jobs belong to")],
           batch_id: Annotated[Optional[str], typer.Option("--batch-id")] = None,
           key: Annotated[Optional[str], typer.Option(help="partition key: tenant, adapter, adapter-balanced or request")] = None,
           config: ConfigOpt = None) -> None:
    """Produce jobs from a native or OpenAI Batch API JSONL file."""
    from aiokafka.errors import KafkaError

    from consumer.submit import SubmitError, new_batch_id, prepare, produce_jobs

    s = _settings(config, **({"kafka.partition_key": key} if key else {}))
    bid = batch_id or new_batch_id()
    try:
        prepared = prepare(file, tenant, bid, max_message_bytes=s.kafka.max_message_bytes, key_by=s.kafka.partition_key)
    except SubmitError as e:
        _fail(str(e))
    for err in prepared.errors:
        console.print(f"[yellow]rejected[/yellow] {file}: {err}", highlight=False)
    if prepared.jobs:
        try:
            with progress_bar() as bar:
                task = bar.add_task("submitting", total=len(prepared.jobs))
                asyncio.run(produce_jobs(s.kafka, prepared.jobs, bid, tenant, str(file), s.kafka.partition_key,
                                         progress=lambda n: bar.advance(task, n)))
        except SubmitError as e:
            _fail(str(e))
        except KafkaError as e:
            # The same batch id gives the same request ids, so jobs already produced are not run twice.
            _fail(_broker_failed(s, e, f"submit again with --batch-id {bid}"))
    typer.echo(json.dumps({"batch_id": bid, "submitted": len(prepared.jobs), "rejected": len(prepared.errors)}))
    if prepared.errors:
        raise typer.Exit(1)


@app.command("results")
def results(batch_id: Annotated[str, typer.Option("--batch-id")],
            tenant: Annotated[str, typer.Option(help="tenant the batch was submitted for")],
            output: Annotated[Optional[Path], typer.Option("-o", "--output", help="write JSONL here instead of stdout")] = None,
            fmt: Annotated[str, typer.Option("--format", help="native or openai")] = "native",
            timeout: Annotated[float, typer.Option(help="seconds to wait for the batch to complete")] = 600.0,
            config: ConfigOpt = None) -> None:
    """Collect a tenant's batch's results until every job has one, as JSONL in submission order."""
    from aiokafka.errors import KafkaError

    from consumer.submit import collect_results, read_manifest, to_openai_line

    if fmt not in ("native", "openai"):
        _fail(f"--format {fmt!r}: use native or openai")
    s = _settings(config)
    try:
        manifest = asyncio.run(read_manifest(s.kafka, tenant, batch_id))
    except KafkaError as e:
        _fail(_broker_failed(s, e))
    if manifest is None:
        _fail(f"no batch {batch_id!r} of tenant {tenant!r} was submitted to {s.kafka.bootstrap_servers}; "
              f"check the id `lorabatch submit` printed and the --tenant it was submitted with")
    with progress_bar() as bar:
        task = bar.add_task(f"batch {tenant}/{batch_id}", total=len(manifest.request_ids))
        try:
            got, dlq = asyncio.run(collect_results(s.kafka, manifest, timeout, progress=lambda n: bar.advance(task, n)))
        except KafkaError as e:
            _fail(_broker_failed(s, e))
    lines = []
    for rid in manifest.request_ids:
        if rid in got:
            lines.append(json.dumps(to_openai_line(got[rid]) if fmt == "openai" else got[rid].model_dump(mode="json")))
        elif rid in dlq:
            lines.append(json.dumps({"request_id": rid, "status": "dlq", "error": dlq[rid].error.model_dump()}))
    text = "\n".join(lines) + ("\n" if lines else "")
    if output:
        output.write_text(text)
    else:
        sys.stdout.write(text)
    missing = len(manifest.request_ids) - len(lines)
    if missing:
        _fail(f"{missing} of {len(manifest.request_ids)} jobs have no result after {timeout:.0f}s; is a worker running?", 1)


# ------------------------------------------------------------------------- demo


@app.command("demo")
def demo(jobs: int = 200, port: Annotated[Optional[int], typer.Option(help="broker port (default: a free one)")] = None,
         home: Annotated[Path, typer.Option(help="where the demo keeps its model, ledger and store")] = Path(".lorabatch/demo")) -> None:
    """The whole service end to end on embedded defaults: broker, worker, ~200 jobs, invoices."""
    from consumer.demo import run_demo

    sys.exit(run_demo(home, jobs, port, console))


def _mount_subcommands() -> None:
    from consumer.cli_bench import bench_app
    from consumer.cli_billing import register_billing

    app.add_typer(bench_app, name="bench")
    register_billing(app)


_mount_subcommands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
