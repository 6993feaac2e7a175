"""`lorabatch bench pipeline`: what the Kafka side costs, measured against the engine alone.

The same jobs run twice on the same engine (the tiny model on the CPU): once straight through
`engine.generate` (all at once, continuously batched), once through the embedded broker and a worker
(parse, route with Redis or the in-process LRU, fair scheduling, results produced, ledger rows
written, offsets committed). The worker is warmed up and has its partitions before the clock starts.
Routing p99 comes from the decision time of each job as the ledger recorded it.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
import time
import uuid
from pathlib import Path

from consumer.broker import EmbeddedBroker, free_port
from consumer.config import load_settings
from consumer.schemas import Job


def _jobs(n: int, tag: str, seed: int = 3) -> list[Job]:
    rng = random.Random(seed)
    words = "invoice refund contract schedule summary translate weather travel product support".split()
    jobs = []
    for i in range(n):
        tenant = ("acme", "globex", "initech")[i % 3]
        fields = {"request_id": f"{tag}-{i}", "tenant_id": tenant, "max_new_tokens": 16,
                  "user_id": f"u{rng.randrange(40)}", "session_id": f"s{rng.randrange(80)}",
                  "prompt": " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))}
        if i % 5 == 0:
            fields["adapter"] = "second"
        jobs.append(Job.model_validate(fields))
    return jobs


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _pipeline(settings, services, engine, jobs: list[Job], warm: list[Job]) -> tuple[float, list[int]]:
    from consumer.schemas import Result
    from consumer.submit import _read_topics, produce_jobs
    from consumer.worker import Worker

    worker = Worker(settings, engine, services.registry, services.ledger)
    task = asyncio.create_task(worker.run())
    seen: set[str] = set()

    def take(_key, value):
        seen.add(Result.model_validate_json(value).request_id)

    try:
        await produce_jobs(settings.kafka, warm, "warm", "acme", "bench", "request")
        await _read_topics(settings.kafka, {settings.kafka.results_topic: take}, False,
                           lambda: len(seen) >= len(warm), 120)
        seen.clear()
        t0 = time.perf_counter()
        await produce_jobs(settings.kafka, jobs, "bench", "acme", "bench", "request")
        wanted = {j.request_id for j in jobs}
        await _read_topics(settings.kafka, {settings.kafka.results_topic: take}, False, lambda: wanted <= seen, 600)
        elapsed = time.perf_counter() - t0
    finally:
        worker.stop()
        await asyncio.wait_for(task, 120)
    rows = [services.ledger.usage_for(j.tenant_id, j.request_id) for j in jobs]
    return elapsed, [r.routing_us for r in rows if r is not None]


def bench_pipeline(jobs: int = 400, redis_url: str | None = None, json_only: bool = False) -> dict:
    from billing.db import upgrade
    from consumer.outcomes import to_request
    from consumer.services import open_services
    from engine.demo_model import write_demo_set
    from engine.engine import Engine
    from migrations import SCRIPT_LOCATION

    home = Path(tempfile.mkdtemp(prefix="lorabatch-bench-"))
    set_dir = home / "set"
    adapters = write_demo_set(set_dir, seed=0)
    port = free_port()
    overrides = {
        "kafka.bootstrap_servers": f"127.0.0.1:{port}", "kafka.group_id": f"bench-{uuid.uuid4().hex[:6]}",
        "engine.model_dir": str(set_dir / "model"), "engine.device": "cpu", "store.adapter_dir": str(home / "store"),
        "ledger.url": f"sqlite:///{home / 'ledger.db'}",
    }
    if redis_url:
        overrides.update({"routing.cache": "redis", "routing.redis_url": redis_url,
                          "routing.redis_prefix": f"lorabatch-bench:{uuid.uuid4().hex[:8]}"})
    s = load_settings(None, overrides)
    k = s.kafka
    broker = EmbeddedBroker(port, log_path=home / "broker.log")
    broker.start([k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
    try:
        upgrade(s.ledger.url, script_location=SCRIPT_LOCATION)
        svc = open_services(s)
        names = sorted(adapters)
        for i, tenant in enumerate(("acme", "globex", "initech")):
            svc.registry.add_tenant(tenant)
            svc.registry.add_adapter(tenant, "main", adapters[names[i]], default=True)
            svc.registry.add_adapter(tenant, "second", adapters[names[i + 3]])
            svc.registry.add_rule(tenant, "keyword", "refund", "second")
        engine = Engine(s.engine)
        # Two job sets of one distribution: the second run must not find the first one's prompts in the
        # prefix cache, or it would look faster than it is.
        work = _jobs(jobs, "engine", seed=3)
        piped = _jobs(jobs, "bench", seed=4)
        snap = svc.registry.snapshot()

        def key(job: Job) -> str:
            name = job.adapter_ref or "main"
            return snap.versions(job.tenant_id, name)[-1].adapter_key

        for (tenant, name), versions in snap.adapters.items():
            engine.load_adapter(versions[-1].adapter_key, svc.registry.store.path(versions[-1].sha256))
        # Engine alone: every job handed over at once, so its continuous batching keeps the batch full,
        # adapters already loaded: the best the engine does with these jobs.
        size = s.worker.max_batch_size
        engine.generate([to_request(j, key(j)) for j in _jobs(size, "warm-engine", seed=9)])
        engine.pop_step_records()
        t0 = time.perf_counter()
        out = engine.generate([to_request(j, key(j)) for j in work])
        tokens = sum(len(r.output_ids) for r in out)
        engine_s = time.perf_counter() - t0
        engine.pop_step_records()  # the engine-alone steps are not the worker's to bill
        pipe_s, routing_us = asyncio.run(_pipeline(s, svc, engine, piped, _jobs(size, "warm", seed=11)))
        svc.close()
    finally:
        broker.stop()
    figures = {
        "jobs": jobs, "cache": "redis" if redis_url else "lru",
        "engine_jobs_per_s": round(jobs / engine_s, 2), "pipeline_jobs_per_s": round(jobs / pipe_s, 2),
        "engine_tok_s": round(tokens / engine_s, 1), "pipeline_cost_pct": round(100 * (pipe_s - engine_s) / engine_s, 1),
        "routing_p50_ms": round(_percentile(routing_us, 0.50) / 1000, 3),
        "routing_p99_ms": round(_percentile(routing_us, 0.99) / 1000, 3),
    }
    if not json_only:
        print(f"{'path':<10} {'seconds':>8} {'jobs/s':>8}")
        print(f"{'engine':<10} {engine_s:>8.2f} {figures['engine_jobs_per_s']:>8.2f}")
        print(f"{'pipeline':<10} {pipe_s:>8.2f} {figures['pipeline_jobs_per_s']:>8.2f}")
        print(f"pipeline cost: {figures['pipeline_cost_pct']}% of the engine's throughput; "
              f"routing ({figures['cache']}) p50 {figures['routing_p50_ms']} ms, p99 {figures['routing_p99_ms']} ms")
    print(json.dumps(figures))
    return figures
