"""`lorabatch bench scaleout`: worker processes in one consumer group, one per GPU, against one worker.

Runs on one machine: the embedded broker, a SQLite ledger, a model folder of the chosen shape with
random weights, and N adapters with zipf popularity. Each scenario starts its workers as processes
(`CUDA_VISIBLE_DEVICES` pins each to its GPU), produces the same jobs, and waits for every result:

- 1 worker, jobs keyed by adapter (the baseline);
- W workers, jobs keyed by adapter;
- W workers, jobs keyed by request;
- W workers, jobs placed by adapter with balanced partitions (consumer.submit.balanced_partitions);

and reports throughput (the W-worker speed-up, keyed by adapter and balanced), adapter loads per
scenario (keying by adapter keeps each adapter on fewer GPUs), and that every job has exactly one
result and one ledger row. With one GPU
(or none) the W workers share it, which checks the mechanics but not the speed-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from consumer.broker import EmbeddedBroker, ensure_topics, free_port
from consumer.config import Settings, load_settings
from consumer.schemas import Job


def _zipf_jobs(n: int, adapters: list[str], tag: str, new_tokens: int, seed: int = 1) -> list[Job]:
    rng = random.Random(seed)
    weights = [1 / (i + 1) for i in range(len(adapters))]
    picks = rng.choices(adapters, weights=weights, k=n)
    return [Job(request_id=f"{tag}-{i}", tenant_id="bench", adapter=a, input_ids=[rng.randrange(10, 200) for _ in range(32)],
                max_new_tokens=new_tokens) for i, a in enumerate(picks)]


WARM_ROUNDS = 60  # warm-up rounds of a job per partition, at most, until every worker has answered one


def _spawn(config: Path, worker_id: str, gpu: str | None, log_dir: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    log = open(log_dir / f"{worker_id}.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config),
                                 "--worker-id", worker_id], stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        log.close()


async def _scenario(s: Settings, config: Path, workers: int, gpus: list[str | None], key_by: str, jobs: list[Job],
                    warm: list[Job], home: Path) -> dict:
    from consumer.schemas import Result
    from consumer.submit import _read_topics, produce_jobs

    procs = [_spawn(config, f"w{i}-{key_by}-{workers}", gpus[i % len(gpus)], home) for i in range(workers)]
    seen: dict[str, int] = {}
    answered_by: set[str] = set()  # workers that have answered a warm-up job

    def take(_key, value):
        r = Result.model_validate_json(value)
        seen[r.request_id] = seen.get(r.request_id, 0) + 1
        answered_by.add(r.worker_id)

    def dead() -> bool:
        return any(p.poll() is not None for p in procs)

    try:
        # Warm-up: a job per partition, again until every worker has answered one, so that the group is formed with all
        # of them and their models are loaded (one worker could answer a whole round before the other joined, and then
        # run the measured jobs alone until a rebalance).
        for round_ in range(WARM_ROUNDS):
            batch = [j.model_copy(update={"request_id": f"{j.request_id}-{round_}"}) for j in warm]
            await produce_jobs(s.kafka, batch, "warm", "bench", "scaleout", "request")
            await _read_topics(s.kafka, {s.kafka.results_topic: take}, False,
                               lambda: dead() or all(j.request_id in seen for j in batch), 900)
            if dead() or len(answered_by) >= workers:
                break
        else:
            raise RuntimeError(f"only {len(answered_by)} of {workers} workers answered in {WARM_ROUNDS} warm-up rounds; "
                               f"see their logs in {home}")
        t0 = time.perf_counter()
        await produce_jobs(s.kafka, jobs, "run", "bench", "scaleout", key_by)
        wanted = {j.request_id for j in jobs}
        await _read_topics(s.kafka, {s.kafka.results_topic: take}, False, lambda: dead() or wanted <= seen.keys(), 1800)
        elapsed = time.perf_counter() - t0
        if dead():
            codes = {p.args[-1]: p.returncode for p in procs if p.returncode is not None}
            raise RuntimeError(f"workers exited mid-run {codes}; see their logs in {home}")
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(120)
            except subprocess.TimeoutExpired:
                p.kill()
    missing = [j.request_id for j in jobs if j.request_id not in seen]
    return {"workers": workers, "key": key_by, "seconds": round(elapsed, 2), "jobs_per_s": round(len(jobs) / elapsed, 2),
            "missing_results": len(missing), "duplicate_results": sum(1 for j in jobs if seen.get(j.request_id, 0) > 1)}


def bench_scaleout(shape: str = "tiny", workers: int = 2, gpus: str | None = None, adapters: int = 64, rank: int = 16,
                   jobs: int = 2000, new_tokens: int = 16, json_only: bool = False) -> dict:
    from billing.db import upgrade
    from consumer.services import open_services
    from engine.adapter_import import AdapterChecks
    from engine.bench.random_model import write_random_adapters, write_random_model
    from migrations import SCRIPT_LOCATION

    home = Path(tempfile.mkdtemp(prefix="lorabatch-scaleout-"))
    gpu_list: list[str | None] = [g for g in gpus.split(",")] if gpus else [None]
    model_dir = home / "model"
    write_random_model(model_dir, shape=shape, seed=0)
    adapter_dirs = write_random_adapters(home / "adapters", shape=shape, count=adapters, rank=rank, seed=1)
    port = free_port()
    device = "cuda" if gpus else "auto"
    base = {
        "kafka.bootstrap_servers": f"127.0.0.1:{port}", "kafka.partitions": 8,
        "engine.model_dir": str(model_dir), "engine.device": device, "engine.max_loras": 32,
        "engine.max_lora_rank": max(rank, 16), "store.adapter_dir": str(home / "store"),
        "ledger.url": f"sqlite:///{home / 'ledger.db'}", "worker.max_adapters_per_batch": 32,
        # Each scenario starts a group afresh; joins are not measured, and the embedded broker answers a JoinGroup after
        # half the session timeout (plus about 3 s for a static member): 2 s here, not 8.
        "kafka.session_timeout_ms": 3000, "kafka.heartbeat_interval_ms": 500, "worker.static_membership": False,
    }
    broker = EmbeddedBroker(port, log_path=home / "broker.log")
    broker.start([], 1)
    rows = []
    try:
        s0 = load_settings(None, base)
        upgrade(s0.ledger.url, script_location=SCRIPT_LOCATION, currency=s0.ledger.currency)
        svc = open_services(s0)
        svc.registry.add_tenant("bench")
        names = []
        checks = AdapterChecks.for_model_dir(model_dir, s0.engine.max_lora_rank)
        for i, path in enumerate(adapter_dirs):
            svc.registry.add_adapter("bench", f"a{i:03d}", path, checks=checks)
            names.append(f"a{i:03d}")
        for n_workers, key_by in ((1, "adapter"), (workers, "adapter"), (workers, "request"), (workers, "adapter-balanced")):
            run = uuid.uuid4().hex[:6]
            s = load_settings(None, {**base, "kafka.jobs_topic": f"{run}.jobs", "kafka.results_topic": f"{run}.results",
                                     "kafka.dlq_topic": f"{run}.dlq", "kafka.batches_topic": f"{run}.batches",
                                     "kafka.group_id": f"scaleout-{run}"})
            k = s.kafka
            asyncio.run(ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions))
            config = home / f"{run}.toml"
            config.write_text(s.to_toml())
            loads_before = svc.ledger.count_adapter_loads()
            work = _zipf_jobs(jobs, names, f"{run}", new_tokens)
            warm = [Job(request_id=f"{run}-warm-{i}", tenant_id="bench", input_ids=[1, 2, 3], max_new_tokens=1,
                        allow_base_fallback=True) for i in range(k.partitions)]
            row = asyncio.run(_scenario(s, config, n_workers, gpu_list, key_by, work, warm, home))
            row["adapter_loads"] = svc.ledger.count_adapter_loads() - loads_before
            row["ledger_rows"] = sum(1 for j in work if svc.ledger.usage_for(j.tenant_id, j.request_id) is not None)
            rows.append(row)
            if not json_only:
                print(f"  {row}", flush=True)
        svc.close()
    finally:
        broker.stop()
    speedup = rows[1]["jobs_per_s"] / rows[0]["jobs_per_s"]
    balanced = rows[3]["jobs_per_s"] / rows[0]["jobs_per_s"]
    figures = {"shape": shape, "workers": workers, "gpus": gpus or "shared", "jobs": jobs, "adapters": adapters,
               "speedup": round(speedup, 2), "speedup_balanced": round(balanced, 2), "scenarios": rows,
               "all_results_and_rows": all(r["missing_results"] == 0 and r["ledger_rows"] == jobs for r in rows)}
    if not json_only:
        print(f"{'workers':>7} {'key':>16} {'seconds':>8} {'jobs/s':>8} {'loads':>6} {'rows':>6} {'missing':>7} {'dups':>5}")
        for r in rows:
            print(f"{r['workers']:>7} {r['key']:>16} {r['seconds']:>8} {r['jobs_per_s']:>8} {r['adapter_loads']:>6} "
                  f"{r['ledger_rows']:>6} {r['missing_results']:>7} {r['duplicate_results']:>5}")
        print(f"speed-up of {workers} workers over 1: {speedup:.2f}x keyed by adapter, {balanced:.2f}x balanced")
    print(json.dumps(figures))
    return figures
