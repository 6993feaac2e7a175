"""`lorabatch bench pipeline`: the service (broker, worker, results, ledger) against the engine alone, stage by stage.

The same kind of jobs run twice on one engine: once straight through `engine.generate` (every job handed over at
once, adapters loaded: the best the engine does with them), once through the embedded broker and a worker (parse,
route with Redis or the in-process LRU, fair scheduling, results produced, SQLite ledger rows written, offsets
committed). Two job sets of one distribution, so that the second run finds none of the first one's prompts in the
prefix cache. With `rounds` > 1 the two paths take turns, each round with job sets of its own, the engine alone first
in the first round and second in the next: a GPU's speed drifts between runs of one process by more than the gap
measured (the H200: 21% between two calls), so the ratio is taken over all rounds and each round's is printed. The
engine-alone run goes to the engine through the idle worker's `call`, between its steps; with the engine in the
worker's process (`worker.engine_process = false`) the idle worker's event loop shares its interpreter lock. Both are warmed up first: the engine with twice its batch of jobs of 1 to `new_tokens` new tokens (so
a GPU's decode graphs of every batch size are captured before the clock starts), the worker with a batch of its own.

What it runs on:
- `shape="tiny"` with `adapters=None` (the defaults): the demo set (engine.demo_model), three tenants with a default
  and a second adapter each and a keyword rule, text prompts; today's CPU demo of the Kafka side's cost;
- any other shape, or an adapter count: a random-weight model of the shape (engine.bench.random_model) and
  `adapters` rank-16 PEFT adapters on all seven projections, registered round-robin to three tenants; each job names
  its adapter (they take turns) and sends `prompt_tokens` random token ids (128 unless given) for `new_tokens`.
The engine keeps the default configuration but for the device: on CUDA its batch, KV pool, adapter pool and readers
are derived from the GPU (engine.sizing), and the worker has its defaults.

It reports jobs/s and tokens/s of both and their ratio; the GPU's idle share between steps, under the engine alone
(1 - the steps' device time / the run's wall time) and under the worker (consumer.stages `EngineClock`); p50 and p99
of each stage of a job's way through the worker (consumer.stages); routing p50/p99 as the ledger recorded it; the CPU
time of the worker's process and of its threads by role in the service run. The measured jobs come from a client
process of its own (`_client`: it produces them all at once when the clock starts and counts the results by their
Kafka key), as a user's producer would, so that none of the client's work shares the worker's interpreter lock.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from consumer.broker import EmbeddedBroker, free_port
from consumer.config import load_settings
from consumer.schemas import Job
from consumer.stages import STAGES, percentile, stage_summary

TENANTS = ("acme", "globex", "initech")
DEFAULT_PROMPT_TOKENS = 128  # of a shaped run's jobs, unless given


@dataclass(frozen=True)
class Workload:
    """The model folder, what each tenant may run, and how jobs are made."""

    model_dir: Path
    adapters: dict[str, list[tuple[str, Path]]]  # tenant -> [(adapter name, folder)], the first its default
    demo: bool  # the demo set's text jobs (else: token ids naming an adapter each)
    vocab: int
    prompt_tokens: int | None
    new_tokens: int

    def jobs(self, n: int, tag: str, seed: int, new_tokens: int | None = None) -> list[Job]:
        """`n` jobs; `new_tokens` (an int, or None for the workload's) as their max_new_tokens."""
        rng = random.Random(seed)
        new = new_tokens or self.new_tokens
        owned = [(tenant, name) for tenant, names in self.adapters.items() for name, _ in names]
        owned.sort(key=lambda tn: tn[1])
        words = "invoice refund contract schedule summary translate weather travel product support".split()
        jobs = []
        for i in range(n):
            fields: dict = {"request_id": f"{tag}-{i}", "max_new_tokens": new}
            if self.demo:
                fields.update(tenant_id=TENANTS[i % 3], user_id=f"u{rng.randrange(40)}", session_id=f"s{rng.randrange(80)}")
                if i % 5 == 0:
                    fields["adapter"] = "second"
            else:
                tenant, name = owned[i % len(owned)]
                fields.update(tenant_id=tenant, adapter=name)
            if self.prompt_tokens is None:
                fields["prompt"] = " ".join(rng.choice(words) for _ in range(rng.randint(6, 20)))
            else:
                fields["input_ids"] = [rng.randrange(10, self.vocab) for _ in range(self.prompt_tokens)]
            jobs.append(Job.model_validate(fields))
        return jobs


def _workload(home: Path, shape: str, adapters: int | None, prompt_tokens: int | None, new_tokens: int) -> Workload:
    from engine.bench.build import SHAPES
    from engine.bench.random_model import write_random_adapters, write_random_model
    from engine.demo_model import write_demo_set

    if shape == "tiny" and adapters is None:
        demo = write_demo_set(home / "set", seed=0)
        names = sorted(demo)
        per_tenant = {t: [("main", demo[names[i]]), ("second", demo[names[i + 3]])] for i, t in enumerate(TENANTS)}
        return Workload(home / "set" / "model", per_tenant, True, _vocab(home / "set" / "model"), prompt_tokens, new_tokens)
    assert shape in SHAPES, f"shape {shape!r}: use one of {sorted(SHAPES)}"
    count = adapters if adapters is not None else 8
    assert count >= 1, count
    model_dir = write_random_model(home / "model", shape=shape, seed=0)
    paths = write_random_adapters(home / "adapters", shape=shape, count=count, rank=16, seed=1)
    per_tenant: dict[str, list[tuple[str, Path]]] = {t: [] for t in TENANTS}
    for i, path in enumerate(paths):
        per_tenant[TENANTS[i % 3]].append((path.name, path))
    return Workload(model_dir, {t: a for t, a in per_tenant.items() if a}, False, _vocab(model_dir),
                    prompt_tokens or DEFAULT_PROMPT_TOKENS, new_tokens)


def _vocab(model_dir: Path) -> int:
    return json.loads((model_dir / "config.json").read_text())["vocab_size"]


def _client(kafka, rounds: list[list[str]], conn) -> None:
    """The bench's client, in a process of its own as a user's producer would be: connect its producer and its results
    reader, then for each round of jobs (JSON) say ("ready",), wait for the go, produce the round while reading the
    results topic, and send back ("done", seconds from the first send to the round's last result, how many never
    came); ("failed", why) if anything fails. Results are counted by their Kafka key (the request id), unparsed.
    Connecting is not timed: it is the client's start-up, not the service's work."""
    from consumer.kafka import make_producer
    from consumer.submit import _read_topics, produce_jobs

    todo = [[Job.model_validate_json(j) for j in jobs] for jobs in rounds]
    wanted, seen = {j.request_id for jobs in todo for j in jobs}, set()
    arrived = asyncio.Event()

    def saw(key: bytes, _value) -> None:
        seen.add(key.decode())
        arrived.set()

    async def run() -> None:
        producer = make_producer(kafka, client_id="lorabatch-bench")
        await producer.start()
        started = asyncio.Event()
        reading = asyncio.create_task(_read_topics(kafka, {kafka.results_topic: saw}, False, lambda: wanted <= seen,
                                                   1800 * len(todo), started))  # 1,800 s a round, engine-alone runs too
        try:
            await asyncio.wait({asyncio.create_task(started.wait()), reading}, return_when=asyncio.FIRST_COMPLETED)
            if not started.is_set():
                reading.result()  # its error, if it raised
                raise RuntimeError(f"the results topic {kafka.results_topic!r} has no partitions to read")
            for jobs in todo:
                ids = {j.request_id for j in jobs}
                conn.send(("ready",))
                await asyncio.to_thread(conn.recv)
                t0 = time.perf_counter()
                await produce_jobs(kafka, jobs, "bench", "acme", "bench", "request", producer=producer)
                while not ids <= seen and not reading.done():
                    arrived.clear()
                    waiter = asyncio.create_task(arrived.wait())
                    await asyncio.wait({waiter, reading}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                conn.send(("done", time.perf_counter() - t0, len(ids - seen)))
        finally:
            reading.cancel()
            await producer.stop()

    try:
        asyncio.run(run())
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        raise


def _from_client(conn, client, timeout_s: float) -> list:
    """The client's next message past its kind; raises if it failed, ended without a word or said nothing in time."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(0.2):
        if not client.is_alive() and not conn.poll(0):
            raise RuntimeError(f"the bench's client process ended (exit code {client.exitcode}) without a word")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the bench's client said nothing within {timeout_s:.0f} s")
    try:
        kind, *value = conn.recv()
    except EOFError:
        client.join(5)  # its end of the pipe closed as it exited: its exit code comes a moment later
        raise RuntimeError(f"the bench's client process ended (exit code {client.exitcode}) without a word") from None
    if kind == "failed":
        raise RuntimeError(f"the bench's client failed: {value[0]}")
    return value


def _thread_cpu(engine_pid: int | None = None) -> dict[str, float]:
    """CPU seconds so far of this process's Python threads, by role: the event loop (this thread), the engine's step
    loop, the executors (ledger writes and stored-answer lookups on consumer/ledger_calls.py's threads, the asyncio
    one's), and the rest; with `engine_pid`, the engine's own process as "engine process" (Linux /proc; empty elsewhere)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}

    def cpu(stat_path: str) -> float | None:
        try:
            stat = Path(stat_path).read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(stat[11]) + int(stat[12])) / tick  # utime + stime

    for t in threading.enumerate():
        if (seconds := cpu(f"/proc/self/task/{t.native_id}/stat")) is None:
            continue
        role = ("loop" if t is threading.current_thread() else "engine" if t.name.startswith("lorabatch-engine")
                else "executor" if t.name.startswith(("asyncio_", "lorabatch-ledger")) else "other")
        out[role] = out.get(role, 0.0) + seconds
    if engine_pid is not None and (seconds := cpu(f"/proc/{engine_pid}/stat")) is not None:
        out["engine process"] = seconds
    return out


async def _service(settings, services, engine, rounds: list[tuple[list[Job], list]], warm: list[Job],
                   profile: Path | None = None) -> list[dict]:
    """Run `warm` from this process through the broker and a worker; then, for each round of (jobs, requests), the
    requests on the engine alone (`_run_alone`, between the idle worker's steps) and the jobs from a client process
    through the service, the engine alone first in even rounds and second in odd ones (so that neither path always
    runs on the warmer machine). Each round's engine-alone figures, and the service run's time, idle share, stamps and
    CPU. With `profile`, the last round's two runs are profiled in the engine's step loop (`<profile>/alone.prof`,
    `<profile>/service.prof`)."""
    from consumer.submit import _read_topics, produce_jobs
    from consumer.worker import Worker

    worker = Worker(settings, engine, services.registry, services.ledger,
                    keep_stages=sum(len(jobs) for jobs, _ in rounds) + len(warm))
    engine_pid = getattr(engine, "pid", None)  # an EngineProcess's child
    task = asyncio.create_task(worker.run())
    seen: set[str] = set()

    async def settled(ids: set[str], timeout_s: float) -> None:  # every one of `ids` has its offset committed
        deadline = time.monotonic() + timeout_s
        while not ids <= {s.key[1] for s in worker.stages.kept} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def counted(run):  # the engine's step counters over `run` (Engine.stats): how its prompts were batched
        before = await worker.aengine.stats()
        result = await run
        after = await worker.aengine.stats()
        return result, {k: after[k] - before[k] for k in ("steps", "prompt_steps", "prompt_step_us", "prompt_tokens")}

    async def profiling(name: str | None) -> None:  # start (None) or stop and write <name>.prof, in the last round
        if profile is not None and len(out) == len(rounds) - 1:
            await worker.aengine.call(functools.partial(_profile, str(profile / f"{name}.prof") if name else ""))

    async def through_service(jobs: list[Job]) -> dict:
        await asyncio.to_thread(_from_client, conn, client, 300)  # connected and reading the results topic
        await worker.restart_measures()
        await worker.aengine.call(_count_compiles)
        await profiling(None)
        cpu0, thread_cpu0 = time.process_time(), _thread_cpu(engine_pid)
        conn.send("go")
        answer = asyncio.create_task(asyncio.to_thread(_from_client, conn, client, 1900))
        await asyncio.wait({answer, task}, return_when=asyncio.FIRST_COMPLETED)
        if not answer.done():
            task.result()  # the worker failed: say why
            raise RuntimeError("the worker stopped before every result came")
        elapsed, missing = answer.result()
        await profiling("service")
        compiles = await worker.aengine.call(_count_compiles)
        cpu, thread_cpu = time.process_time() - cpu0, _thread_cpu(engine_pid)
        thread_cpu = {role: round(s - thread_cpu0.get(role, 0.0), 2) for role, s in thread_cpu.items()}
        if missing:
            raise RuntimeError(f"{missing} of {len(jobs)} results never came within the client's 1800 s")
        idle = await worker.gpu_idle_share()
        clock = worker.engine_clock
        await settled({j.request_id for j in jobs}, 30)
        return {"seconds": elapsed, "idle": idle, "steps": clock.steps, "busy_us": clock.busy_us,
                "occupied_s": clock.occupied_ns() / 1e9, "loop_cpu_s": thread_cpu.get("loop", 0.0), "cpu_s": cpu,
                "thread_cpu_s": thread_cpu, "compiles": compiles}

    k = settings.kafka
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client = ctx.Process(target=_client, args=(k, [[j.model_dump_json() for j in jobs] for jobs, _ in rounds], child_conn),
                         daemon=True)  # fmt: skip
    out = []
    try:
        await produce_jobs(k, warm, "warm", "acme", "bench", "request")
        await _read_topics(k, {k.results_topic: lambda key, _v: seen.add(key.decode())}, False,
                           lambda: task.done() or len(seen) >= len(warm), 600)
        await settled({j.request_id for j in warm}, 30)
        client.start()
        child_conn.close()  # the client's end lives in the client alone: its death reads as the end of the pipe
        for i, (jobs, requests) in enumerate(rounds):
            if i % 2:
                ran, ran["counts"] = await counted(through_service(jobs))
            await profiling(None)
            alone, counts = await counted(worker.aengine.call(functools.partial(_run_alone, requests)))
            alone["counts"] = counts
            await profiling("alone")
            assert not alone["failed"], f"{len(alone['failed'])} jobs failed in the engine alone, e.g. {alone['failed'][0]}"
            if not i % 2:
                ran, ran["counts"] = await counted(through_service(jobs))
            wanted = {j.request_id for j in jobs}
            out.append({"alone": alone, **ran, "stamps": [s for s in worker.stages.kept if s.key[1] in wanted]})
    finally:
        if client.is_alive():
            client.kill()
        worker.stop()
        await asyncio.wait_for(task, 120)
    return out


def bench_pipeline(jobs: int = 400, redis_url: str | None = None, json_only: bool = False, *, device: str = "cpu",
                   shape: str = "tiny", adapters: int | None = None, prompt_tokens: int | None = None,
                   new_tokens: int = 16, rounds: int = 1, profile: Path | None = None) -> dict:
    from billing.db import upgrade
    from consumer.outcomes import to_request
    from consumer.services import open_services
    from engine.adapter_import import AdapterChecks
    from engine.engine import Engine
    from engine.engine_process import EngineProcess
    from migrations import SCRIPT_LOCATION

    started = time.perf_counter()

    def say(what: str) -> None:  # progress on stderr: at llama-1b a run takes minutes before its table
        if not json_only:
            print(f"[{time.perf_counter() - started:6.1f} s] {what}", file=sys.stderr, flush=True)

    home = Path(tempfile.mkdtemp(prefix="lorabatch-bench-"))
    load = _workload(home, shape, adapters, prompt_tokens, new_tokens)
    say(f"model and adapters written under {home}")
    port = free_port()
    overrides = {
        "kafka.bootstrap_servers": f"127.0.0.1:{port}", "kafka.group_id": f"bench-{uuid.uuid4().hex[:6]}",
        "engine.model_dir": str(load.model_dir), "engine.device": device, "store.adapter_dir": str(home / "store"),
        "ledger.url": f"sqlite:///{home / 'ledger.db'}", "worker.spool_path": str(home / "spool.sqlite"),
    }
    if redis_url:
        overrides.update({"routing.cache": "redis", "routing.redis_url": redis_url,
                          "routing.redis_prefix": f"lorabatch-bench:{uuid.uuid4().hex[:8]}"})
    s = load_settings(None, overrides)
    k = s.kafka
    broker = EmbeddedBroker(port, log_path=home / "broker.log")
    broker.start([k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
    try:
        upgrade(s.ledger.url, script_location=SCRIPT_LOCATION, currency=s.ledger.currency)
        svc = open_services(s)
        checks = AdapterChecks.for_model_dir(Path(s.engine.model_dir), s.engine.max_lora_rank)
        for tenant, owned in load.adapters.items():
            svc.registry.add_tenant(tenant)
            for i, (name, path) in enumerate(owned):
                svc.registry.add_adapter(tenant, name, path, default=i == 0, checks=checks)
            if load.demo:
                svc.registry.add_rule(tenant, "keyword", "refund", "second")
        if s.worker.engine_process:  # as `lorabatch worker` runs it: the engine-alone run goes to the child too
            engine = EngineProcess(s.engine)
            engine.start()

            def on_engine(fn):
                return asyncio.run(engine.call(fn))
        else:
            engine = Engine(s.engine)

            def on_engine(fn):
                return fn(engine)
        host = f"its own process (pid {engine.pid})" if s.worker.engine_process else "a thread of the worker"
        name = on_engine(_device_name)
        say(f"engine loaded on {name} in {host}, batch {engine.config.max_batch_size}")
        snap = svc.registry.snapshot()

        def key(job: Job) -> str:
            name = job.adapter_ref or load.adapters[job.tenant_id][0][0]
            return snap.versions(job.tenant_id, name)[-1].adapter_key

        on_engine(functools.partial(_load_adapters, [(versions[-1].adapter_key, svc.registry.store.path(versions[-1].sha256))
                                                     for versions in snap.adapters.values()]))  # fmt: skip
        # Warm-up: twice the engine's batch, new tokens from 1 up, so the batch shrinks through every size (a GPU
        # captures a decode graph per size bucket: none of that may fall inside the measured runs).
        size = engine.config.max_batch_size
        warm = [j.model_copy(update={"max_new_tokens": 1 + i % load.new_tokens})
                for i, j in enumerate(load.jobs(2 * size, "warm-engine", seed=9))]
        on_engine(functools.partial(_run_alone, [to_request(j, key(j)) for j in warm]))
        if device == "cuda":  # then one whole pass of the measured kind, unmeasured: on the H200 (session 11) the first
            # such pass after the warm-up above still met kernel variants (prompt-step shapes) and ran 17% slower
            on_engine(functools.partial(_run_alone, [to_request(j, key(j)) for j in load.jobs(jobs, "warm-pass", seed=5)]))
        say(f"engine warmed up on {len(warm)} jobs" + (f" and a pass of {jobs}" if device == "cuda" else ""))
        # Engine alone: every job at once, so its continuous batching keeps the batch full. Each round runs a job set
        # of its own through each path (the prefix cache finds no prompt of an earlier one).
        plan = [(load.jobs(jobs, f"bench{r}", seed=101 + 2 * r),  # seeds of their own: the warm-up's prompts are cached
                 [to_request(j, key(j)) for j in load.jobs(jobs, f"engine{r}", seed=100 + 2 * r)]) for r in range(rounds)]
        warm_service = load.jobs(s.worker.max_batch_size, "warm", seed=11)
        if profile is not None:
            profile.mkdir(parents=True, exist_ok=True)
        ran = asyncio.run(_service(s, svc, engine, plan, warm_service, profile))  # closes the engine
        for r, one in enumerate(ran):
            say(f"round {r + 1}: engine alone {one['alone']['seconds']:.2f} s, service {one['seconds']:.2f} s "
                f"({one['alone']['seconds'] / one['seconds']:.3f}x)")
        piped = [j for jobs, _ in plan for j in jobs]
        rows = [svc.ledger.usage_for(j.tenant_id, j.request_id) for j in piped]
        svc.close()
    finally:
        broker.stop()
    engine_s, pipe_s = sum(one["alone"]["seconds"] for one in ran), sum(one["seconds"] for one in ran)
    engine_busy_us, engine_steps = sum(one["alone"]["busy_us"] for one in ran), sum(one["alone"]["steps"] for one in ran)
    engine_tokens = sum(one["alone"]["tokens"] for one in ran)
    busy_us, steps = sum(one["busy_us"] for one in ran), sum(one["steps"] for one in ran)
    thread_cpu: dict[str, float] = {}
    for one in ran:
        for role, cpu in one["thread_cpu_s"].items():
            thread_cpu[role] = round(thread_cpu.get(role, 0.0) + cpu, 2)
    routing_us = [r.routing_us for r in rows if r is not None]
    pipe_tokens = sum(r.output_tokens for r in rows if r is not None)
    not_succeeded = sum(1 for r in rows if r is None or r.status != "succeeded")
    engine_idle = max(0.0, 1 - engine_busy_us / (engine_s * 1e6))
    idles = [one["idle"] for one in ran if one["idle"] is not None]
    total = jobs * rounds
    figures = {
        "jobs": total, "rounds": rounds, "cache": "redis" if redis_url else "lru", "device": device, "device_name": name,
        "engine_host": "process" if s.worker.engine_process else "thread",
        "shape": shape, "adapters": sum(len(a) for a in load.adapters.values()),
        "prompt_tokens": load.prompt_tokens, "new_tokens": load.new_tokens,
        "engine_jobs_per_s": round(total / engine_s, 2), "pipeline_jobs_per_s": round(total / pipe_s, 2),
        "engine_tok_s": round(engine_tokens / engine_s, 1), "pipeline_tok_s": round(pipe_tokens / pipe_s, 1),
        "ratio": round(engine_s / pipe_s, 3), "tok_ratio": round((pipe_tokens / pipe_s) / (engine_tokens / engine_s), 3),
        "round_ratios": [round(one["alone"]["seconds"] / one["seconds"], 3) for one in ran],
        "pipeline_cost_pct": round(100 * (pipe_s - engine_s) / engine_s, 1),
        "engine_gpu_idle_share": round(engine_idle, 4),
        "gpu_idle_share": (round(sum(one["idle"] * one["seconds"] for one in ran) / pipe_s, 4)  # weighted by time
                           if len(idles) == len(ran) else None),
        "stages": stage_summary([st for one in ran for st in one["stamps"]]),
        "staged_jobs": sum(len(one["stamps"]) for one in ran), "not_succeeded": not_succeeded,
        "routing_p50_ms": round(percentile(routing_us, 0.50) / 1000, 3),
        "routing_p99_ms": round(percentile(routing_us, 0.99) / 1000, 3),
        "engine_batch": engine.config.max_batch_size,
        # Where a gap comes from: more steps (smaller batches), slower steps (the host shared), or idle time between.
        "engine_steps": engine_steps, "service_steps": steps,
        "engine_compiles": _known_sum(one["alone"]["compiles"] for one in ran),  # Triton variants met while measured
        "service_compiles": _known_sum(one["compiles"] for one in ran),
        "engine_step_ms": round(engine_busy_us / max(1, engine_steps) / 1000, 3),
        "service_step_ms": round(busy_us / max(1, steps) / 1000, 3),
        "service_engine_s": round(sum(one["occupied_s"] for one in ran), 2),
        # How each path's prompts were batched: steps holding prompt tokens, their mean device ms and prompt tokens.
        **{f"{path}_{k}": v for path, counts in (("engine", [one["alone"]["counts"] for one in ran]),
                                                 ("service", [one["counts"] for one in ran]))
           for k, v in _prompt_figures(counts).items()},
        # Host CPU during the service runs: the event loop's thread (the worker's tasks and the bench's client), and the
        # whole process (the engine thread, reader processes' pipes, ledger writes in threads, torch's own threads).
        "loop_cpu_s": round(sum(one["loop_cpu_s"] for one in ran), 2), "process_cpu_s": round(sum(one["cpu_s"] for one in ran), 2),
        "thread_cpu_s": thread_cpu,
    }
    if not json_only:
        _print_table(figures, engine_s, pipe_s)
        if profile is not None:
            _print_profile_gap(profile / "alone.prof", profile / "service.prof")
    print(json.dumps(figures))
    return figures


def _print_profile_gap(alone: Path, service: Path, top: int = 25) -> None:
    """The functions whose own time in the engine's step loop grew most from the engine alone to the service (the last
    round's two runs, the same number of jobs each): where the engine's process spends what the service costs it."""
    import pstats

    def own(path: Path) -> dict:
        return {key: (row[1], row[2]) for key, row in pstats.Stats(str(path)).stats.items()}  # (calls, own seconds)

    a, b = own(alone), own(service)
    total_a, total_b = sum(t for _, t in a.values()), sum(t for _, t in b.values())
    print(f"engine step loop, own seconds under the profiler: alone {total_a:.2f}, service {total_b:.2f} "
          f"(stats in {alone.parent})")
    print(f"{'function':<64} {'calls alone':>11} {'calls svc':>10} {'alone s':>8} {'service s':>9} {'more s':>7}")
    for key in sorted(a.keys() | b.keys(), key=lambda k: a.get(k, (0, 0.0))[1] - b.get(k, (0, 0.0))[1])[:top]:
        (ca, ta), (cb, tb) = a.get(key, (0, 0.0)), b.get(key, (0, 0.0))
        where = f"{Path(key[0]).name}:{key[1]} {key[2]}"[-64:]
        print(f"{where:<64} {ca:>11} {cb:>10} {ta:>8.3f} {tb:>9.3f} {tb - ta:>7.3f}")


def _prompt_figures(counts: list[dict]) -> dict:
    steps = sum(c["prompt_steps"] for c in counts)
    return {"prompt_steps": steps, "prompt_step_ms": round(sum(c["prompt_step_us"] for c in counts) / max(1, steps) / 1000, 3),
            "prompt_tokens_per_step": round(sum(c["prompt_tokens"] for c in counts) / max(1, steps), 1)}


def _known_sum(values) -> int | None:
    """The sum of the counts that are known (None: the count could not be taken)."""
    known = [v for v in values if v is not None]
    return sum(known) if known else None


# Run on the engine wherever it is (module-level, so that they pickle to an engine in its own process).


def _device_name(engine) -> str:
    import torch

    return torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"


def _load_adapters(pairs: list[tuple[str, Path]], engine) -> None:
    for adapter_key, path in pairs:
        engine.load_adapter(adapter_key, path)


def _run_alone(requests: list, engine) -> dict:
    """`requests` through `engine.generate` at once, timed; its steps popped (not the worker's to bill)."""
    from engine.bench.instruments import Compiles

    engine.pop_step_records()
    with Compiles() as compiles:
        t0 = time.perf_counter()
        out = engine.generate(requests)
        seconds = time.perf_counter() - t0
    records = engine.pop_step_records()
    return {"seconds": seconds, "busy_us": sum(r.total_us for r in records), "steps": len(records), "compiles": compiles.take(),
            "tokens": sum(len(r.output_ids) for r in out), "failed": [str(r.error) for r in out if r.error is not None]}


_COUNTING: list = []  # the service run's compile counter, in the engine's process
_PROFILING: list = []  # the profiler running in the engine's process (`profile`)


def _profile(path: str, engine) -> None:
    """Start profiling the engine's step loop (cProfile, its thread only); the next call stops and writes the stats to
    `path` (its own path is ignored)."""
    import cProfile

    if _PROFILING:
        profiler = _PROFILING.pop()
        profiler.disable()
        profiler.dump_stats(path)
        return
    profiler = cProfile.Profile()
    _PROFILING.append(profiler)
    profiler.enable()


def _count_compiles(engine) -> int | None:
    """Start counting Triton compiles in the engine's process; the next call stops and returns the count."""
    from engine.bench.instruments import Compiles

    if _COUNTING:
        counter = _COUNTING.pop()
        counter.__exit__(None, None, None)
        return counter.take()
    _COUNTING.append(Compiles().__enter__())
    return None


def _print_table(f: dict, engine_s: float, pipe_s: float) -> None:
    print(f"{f['shape']} on {f['device_name']}: {f['jobs']} jobs, {f['adapters']} adapters, prompt "
          f"{f['prompt_tokens'] or 'text'}, {f['new_tokens']} new tokens; engine batch {f['engine_batch']}")
    print(f"{'path':<8} {'seconds':>8} {'jobs/s':>8} {'tokens/s':>9} {'GPU idle':>9}")
    print(f"{'engine':<8} {engine_s:>8.2f} {f['engine_jobs_per_s']:>8.2f} {f['engine_tok_s']:>9.1f} {f['engine_gpu_idle_share']:>9.3f}")
    idle = f"{f['gpu_idle_share']:.3f}" if f["gpu_idle_share"] is not None else "-"
    print(f"{'service':<8} {pipe_s:>8.2f} {f['pipeline_jobs_per_s']:>8.2f} {f['pipeline_tok_s']:>9.1f} {idle:>9}")
    print(f"steps: engine {f['engine_steps']} of {f['engine_step_ms']} ms, service {f['service_steps']} of "
          f"{f['service_step_ms']} ms (mean device time); Triton compiles while measured: engine {f['engine_compiles']}, "
          f"service {f['service_compiles']}; the service's engine held jobs {f['service_engine_s']} s; "
          f"CPU s: process {f['process_cpu_s']}, " + ", ".join(f"{k} {v}" for k, v in sorted(f["thread_cpu_s"].items())))
    print(f"steps with prompt tokens: engine {f['engine_prompt_steps']} of {f['engine_prompt_step_ms']} ms, "
          f"{f['engine_prompt_tokens_per_step']} prompt tokens each; service {f['service_prompt_steps']} of "
          f"{f['service_prompt_step_ms']} ms, {f['service_prompt_tokens_per_step']} each")
    if f["rounds"] > 1:
        print(f"{f['rounds']} rounds, each path's jobs/s in turn (engine first in rounds 1, 3, ...): service / engine "
              + ", ".join(f"{r:.3f}" for r in f["round_ratios"]))
    print(f"service / engine: {f['ratio']:.3f}x jobs/s, {f['tok_ratio']:.3f}x tokens/s; routing ({f['cache']}) "
          f"p50 {f['routing_p50_ms']} ms, p99 {f['routing_p99_ms']} ms")
    print(f"{'stage':<8} {'p50 ms':>9} {'p99 ms':>9}   ({f['staged_jobs']} jobs)")
    for name in STAGES:
        print(f"{name:<8} {f['stages'][name]['p50_ms']:>9.3f} {f['stages'][name]['p99_ms']:>9.3f}")
