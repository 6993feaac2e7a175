"""`lorabatch demo`: the whole service end to end on embedded defaults.

Starts the embedded broker, writes the tiny model and 8 adapters for 3 tenants where absent, registers
them, starts a worker process, submits about 200 jobs mixing tenants and adapters (a few of them
invalid), waits for every result, prints each tenant's invoice and the DLQ count, and stops what it
started.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from consumer.broker import EmbeddedBroker, free_port
from consumer.config import Settings, load_settings
from consumer.kafka import make_producer
from consumer.schemas import BatchManifest, DlqRecord, Job
from consumer.submit import collect_results, produce_jobs

TENANTS = ("acme", "globex", "initech")
PROMPTS = (
    "Summarise the quarterly report in one line:",
    "Translate to French: the invoice is due on Friday.",
    "Write a haiku about batch inference.",
    "Classify the sentiment: the service was quick and friendly.",
    "Extract the dates: the meeting moved from May 3 to May 10.",
    "Answer briefly: what is a LoRA adapter?",
    "Continue the story: the GPU hummed quietly as",
    "List three uses of a message queue.",
)


def write_config(home: Path, port: int) -> Path:
    """The demo's own config file: everything under `home`, the broker on `port`."""
    cfg = {
        "kafka": {"bootstrap_servers": f"127.0.0.1:{port}", "group_id": "lorabatch-demo"},
        "broker": {"port": port, "state_dir": str(home / "broker")},
        "worker": {"max_batch_size": 32, "metrics_port": 0, "spool_path": str(home / "spool.sqlite")},
        "store": {"adapter_dir": str(home / "adapters")},
        "engine": {"model_dir": str(home / "set" / "model"), "device": "cpu", "max_new_tokens": 64},
        "ledger": {"url": f"sqlite:///{home / 'ledger.db'}"},
    }
    path = home / "lorabatch.toml"
    path.write_text(Settings.model_validate(cfg).to_toml())
    return path


def prepare_registry(settings: Settings, home: Path, console: Console) -> dict[str, list[str]]:
    """Model, adapters, schema, tenants: each made only where absent. Returns tenant -> adapter names."""
    from billing.db import upgrade
    from billing.prices import set_token_price
    from consumer.services import open_services
    from engine.adapter_import import AdapterChecks
    from engine.demo_model import write_demo_set
    from migrations import SCRIPT_LOCATION

    set_dir = home / "set"
    if not (set_dir / "model" / "config.json").exists():
        console.print(f"writing the tiny model and 8 adapters to {set_dir}")
        write_demo_set(set_dir, seed=0)
    paths = {p.name: p for p in sorted((set_dir / "adapters").iterdir()) if p.is_dir()}
    upgrade(settings.ledger.url, script_location=SCRIPT_LOCATION, currency=settings.ledger.currency)
    svc = open_services(settings)
    month_start = datetime.now(UTC).date().replace(day=1)
    # Revenue side: what the tiers pay per million input/output tokens (the cost side is the GPU price).
    set_token_price(svc.db, "standard", Decimal("0.20"), Decimal("0.60"), month_start, currency=settings.ledger.currency)
    set_token_price(svc.db, "premium", Decimal("0.50"), Decimal("1.50"), month_start, currency=settings.ledger.currency)
    names = sorted(paths)
    owned = {t: names[i::len(TENANTS)] for i, t in enumerate(TENANTS)}  # 3 / 3 / 2 adapters
    checks = AdapterChecks.for_model_dir(Path(settings.engine.model_dir), settings.engine.max_lora_rank)
    try:
        for tenant in TENANTS:
            svc.registry.ensure_tenant(tenant, tier="premium" if tenant == "acme" else "standard")
            for i, name in enumerate(owned[tenant]):
                svc.registry.add_adapter(tenant, name, paths[name], default=(i == 0), public=(tenant == "acme" and i == 1),
                                         checks=checks)
    finally:
        svc.close()
    return owned


def make_jobs(owned: dict[str, list[str]], n: int, run: str, max_new_tokens: int, rng: random.Random) -> dict[str, list[Job]]:
    jobs: dict[str, list[Job]] = {t: [] for t in TENANTS}
    public = owned["acme"][1]
    for i in range(n):
        tenant = TENANTS[i % len(TENANTS)]
        kind = rng.random()
        fields: dict = {"request_id": f"{run}-{i}", "tenant_id": tenant, "batch_id": f"{run}-{tenant}",
                        "max_new_tokens": rng.choice((8, 16, 24)), "user_id": f"user-{rng.randrange(20)}"}
        if kind < 0.55:
            fields["adapter_ref"] = rng.choice(owned[tenant])
        elif kind < 0.65:
            fields["adapter_ref"] = public  # acme's public adapter, usable by everyone
        elif kind < 0.7:
            fields["allow_base_fallback"] = True
            if tenant != "initech":
                fields["adapter_ref"] = rng.choice(owned[tenant])
        if rng.random() < 0.3:
            fields.update(temperature=0.8, top_p=0.9, seed=rng.randrange(1000))
        if rng.random() < 0.2:
            fields["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        else:
            fields["prompt"] = rng.choice(PROMPTS)
        jobs[tenant].append(Job.model_validate(fields))
    # Invalid but answerable: each gets a failed result that names the field and the fix.
    jobs["acme"].append(Job.model_validate({"request_id": f"{run}-bad-adapter", "tenant_id": "acme",
                                            "batch_id": f"{run}-acme", "adapter_ref": "no-such-adapter", "prompt": "hi"}))
    jobs["globex"].append(Job.model_validate({"request_id": f"{run}-too-long", "tenant_id": "globex", "batch_id": f"{run}-globex",
                                              "prompt": "hi", "max_new_tokens": max_new_tokens + 1}))
    return jobs


async def produce_garbage(settings: Settings, run: str) -> int:
    """Messages no worker can answer: they must land in the DLQ with their reason."""
    bad = [b"{not json", json.dumps({"tenant_id": "acme", "prompt": "no request id"}).encode(),
           json.dumps(["an", "array"]).encode()]
    producer = make_producer(settings.kafka)
    await producer.start()
    try:
        for value in bad:
            await producer.send_and_wait(settings.kafka.jobs_topic, value, key=run.encode())
    finally:
        await producer.stop()
    return len(bad)


async def count_dlq(settings: Settings, since_ms: int) -> int:
    from consumer.submit import _read_topics

    seen: list[DlqRecord] = []

    def take(_key, value):
        rec = DlqRecord.model_validate_json(value)
        if (rec.source_timestamp_ms or 0) >= since_ms:
            seen.append(rec)

    await _read_topics(settings.kafka, {settings.kafka.dlq_topic: take}, True, lambda: False, 10.0)
    return len(seen)


def run_demo(home: Path, n_jobs: int, port: int | None, console: Console) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    started = time.monotonic()
    home = home.resolve()
    home.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    config_path = write_config(home, port)
    settings = load_settings(config_path)
    k = settings.kafka
    broker = EmbeddedBroker(port, log_path=home / "broker.log")
    worker = None
    try:
        console.print(f"starting the embedded broker on 127.0.0.1:{port}")
        broker.start([k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
        owned = prepare_registry(settings, home, console)
        log = open(home / "worker.log", "ab")
        console.print(f"starting a worker (log: {home / 'worker.log'})")
        worker = subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config_path)],
                                  stdout=log, stderr=subprocess.STDOUT)
        log.close()
        run = "demo-" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
        rng = random.Random(7)
        jobs = make_jobs(owned, n_jobs, run, settings.engine.max_new_tokens, rng)
        since_ms = int(time.time() * 1000) - 1000
        total = sum(len(v) for v in jobs.values())

        async def submit_and_collect(progress) -> dict:
            for tenant, tj in jobs.items():
                await produce_jobs(k, tj, f"{run}-{tenant}", tenant, "demo", k.partition_key)
            garbage = await produce_garbage(settings, run)
            manifests = [BatchManifest(batch_id=f"{run}-{t}", tenant_id=t, request_ids=[j.request_id for j in jobs[t]])
                         for t in TENANTS]
            collected = await asyncio.gather(*(collect_results(k, m, 300, progress) for m in manifests))
            return {"garbage": garbage, "results": [r for got, _ in collected for r in got.values()]}

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console) as bar:
            task = bar.add_task(f"{total} jobs", total=total)
            out = asyncio.run(submit_and_collect(lambda n: bar.advance(task, n)))
        results = out["results"]
        if worker.poll() is not None:
            console.print(f"[red]the worker exited with code {worker.returncode}; see {home / 'worker.log'}[/red]")
            return 1
        ok = sum(r.status == "succeeded" for r in results)
        console.print(f"\n{len(results)} results: {ok} succeeded, {len(results) - ok} failed (invalid on purpose: "
                      f"{sum(1 for r in results if r.error and r.error.code in ('unknown_adapter', 'max_new_tokens_too_large'))})")
        for r in results:
            if r.status == "failed":
                console.print(escape(f"  failed {r.request_id}: [{r.error.code}] {r.error.message}"), highlight=False, soft_wrap=True)
        print_invoices(settings, console)
        dlq = asyncio.run(count_dlq(settings, since_ms))
        console.print(f"DLQ: {dlq} messages (sent {out['garbage']} unparsable on purpose)")
        console.print(f"demo finished in {time.monotonic() - started:.1f}s")
        return 0 if len(results) == total and dlq == out["garbage"] else 1
    finally:
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        broker.stop()


def print_invoices(settings: Settings, console: Console) -> None:
    from billing.invoice import build_invoice
    from billing.finance import finance_report
    from billing.invoice_render import render_table
    from billing.report_render import render_report_table
    from consumer.services import open_services

    svc = open_services(settings)
    period = datetime.now(UTC).strftime("%Y-%m")
    try:
        for tenant in TENANTS:
            inv = build_invoice(svc.db, tenant, period, settings.ledger)
            print(f"\n{render_table(inv)}", flush=True)  # plain stdout: a console would wrap the wide table
        print(render_report_table(finance_report(svc.db, period, settings.ledger)), flush=True)
    finally:
        svc.close()
