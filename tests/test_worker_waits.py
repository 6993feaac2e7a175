"""The worker waits for its dependencies instead of dying, and says what it waits for; SIGTERM drains with a
summary line."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import uuid

import pytest

from consumer.broker import EmbeddedBroker, free_port
from consumer.config import load_settings
from consumer.schemas import Result
from consumer.waits import Stopped, wait_for
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import open_services, produce_raw, read_all, running_worker


def _flaky(failures: int, error=ConnectionRefusedError("connection refused")):
    calls = []

    async def attempt():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return "up"
    return attempt, calls


async def test_wait_for_retries_until_the_dependency_answers(caplog):
    """Each failed attempt is one line naming what is waited for and why; the backoff doubles up to its cap."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    attempt, calls = _flaky(5)
    assert await wait_for("the thing at x:1", attempt, first_s=0.001, max_s=0.004, hint="start it") == "up"
    assert len(calls) == 6
    lines = [r.getMessage() for r in caplog.records]
    waiting = [m for m in lines if m.startswith("waiting for the thing at x:1")]
    assert len(waiting) == 5 and all("ConnectionRefusedError: connection refused" in m and "start it" in m for m in waiting)
    assert [m.rsplit("next attempt in ", 1)[1] for m in waiting] == ["0.0s"] * 5  # 1, 2, 4, 4, 4 ms
    assert any("available after" in m and "6 attempts" in m for m in lines)


async def test_wait_for_succeeding_at_once_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    attempt, calls = _flaky(0)
    assert await wait_for("x", attempt) == "up" and len(calls) == 1 and not caplog.records


async def test_a_stop_ends_the_wait_and_cancellation_is_not_swallowed():
    stopping = asyncio.Event()
    attempt, calls = _flaky(10**9)
    task = asyncio.create_task(wait_for("x", attempt, stopping=stopping, first_s=30, max_s=30))
    await asyncio.sleep(0.05)
    stopping.set()  # wakes the 30 s pause at once
    with pytest.raises(Stopped):
        await asyncio.wait_for(task, 5)
    task = asyncio.create_task(wait_for("x", attempt, first_s=30, max_s=30))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_stop_ends_an_attempt_that_hangs_and_a_long_one_is_said(monkeypatch, caplog):
    """An attempt that never returns (a Kafka consumer's start stuck joining a group whose dead static member holds
    it: an operator's drill saw a replacement worker ignore SIGTERM there) is cancelled by the stop, which raises
    Stopped; while it runs, each SLOW_ATTEMPT_S is a log line saying what is waited for."""
    import consumer.waits as waits

    monkeypatch.setattr(waits, "SLOW_ATTEMPT_S", 0.05)
    caplog.set_level(logging.WARNING, logger="lorabatch.worker")
    stopping, cleaned = asyncio.Event(), []

    async def hangs():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(1)

    task = asyncio.create_task(wait_for("the group", hangs, stopping=stopping))
    await asyncio.sleep(0.2)
    stopping.set()
    with pytest.raises(Stopped, match="the group"):
        await asyncio.wait_for(task, 5)
    assert cleaned == [1], "the attempt was cancelled, its cleanup ran"
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting for the group")]
    assert len(said) >= 2 and "SIGTERM stops the wait" in said[0], said


async def test_give_up_raises_the_last_error():
    attempt, calls = _flaky(10**9, OSError("no route"))
    with pytest.raises(OSError, match="no route"):
        await wait_for("x", attempt, first_s=0.001, max_s=0.001, give_up_s=0.02)
    assert len(calls) >= 2


async def test_unknown_errors_are_waited_out_too():
    """Whatever the dependency raises (here a KeyError from a half-started client) is one more attempt."""
    attempt, calls = _flaky(2, KeyError("node"))
    assert await wait_for("x", attempt, first_s=0.001, max_s=0.001) == "up" and len(calls) == 3


@pytest.mark.slow
@ONE_LEDGER
async def test_worker_started_before_its_broker_waits_then_serves_and_drains_on_sigterm(tmp_path, demo_set, cpu_engine,
                                                                                      ledger_url, caplog):
    """No broker at start: the worker logs its waits (a few lines, no traceback); the broker comes up 3 s later
    on that port; the job is served; SIGTERM gives one summary line of the drain."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    run = uuid.uuid4().hex[:8]
    port = free_port()
    s = load_settings(None, {
        "kafka.bootstrap_servers": f"127.0.0.1:{port}", "kafka.jobs_topic": f"{run}.jobs",
        "kafka.results_topic": f"{run}.results", "kafka.dlq_topic": f"{run}.dlq", "kafka.batches_topic": f"{run}.batches",
        "kafka.group_id": f"workers-{run}", "kafka.partitions": 2, "store.adapter_dir": str(tmp_path / "store"),
        "engine.model_dir": str(demo_set["model"]), "engine.device": "cpu", "engine.max_new_tokens": 32,
        "engine.max_prompt_tokens": 200, "worker.commit_interval_ms": 50, "worker.wait_max_s": 1.0,
        "worker.spool_path": str(tmp_path / "spool.sqlite"), "ledger.url": ledger_url,
    })
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    k = s.kafka
    broker = EmbeddedBroker(port, log_path=tmp_path / "tansu.log")
    loop = asyncio.get_running_loop()
    try:
        async with running_worker(s, svc, cpu_engine) as rw:
            await asyncio.sleep(3)
            assert not rw.task.done(), "the worker must wait for its broker, not exit"
            waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"waiting for the Kafka broker at 127.0.0.1:{port}")]
            assert 2 <= len(waits) <= 8, waits  # 0.5 s, then 1 s pauses: a line a second at most
            assert "lorabatch broker start" in waits[0] and not any(r.exc_info for r in caplog.records)
            await asyncio.to_thread(broker.start, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
            await produce_raw(s, [json.dumps({"request_id": f"w{i}", "tenant_id": "acme", "prompt": f"hi {i}",
                                              "max_new_tokens": 3}).encode() for i in range(4)])
            results = await read_all(s, k.results_topic, Result, lambda got: len(got) >= 4)
            assert sorted(r.request_id for r in results) == ["w0", "w1", "w2", "w3"]
            assert all(r.status == "succeeded" for r in results)
            assert any("available after" in r.getMessage() for r in caplog.records)

            loop.add_signal_handler(signal.SIGTERM, rw.worker.stop)  # as `lorabatch worker` does
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                await asyncio.wait_for(rw.task, 60)
            finally:
                loop.remove_signal_handler(signal.SIGTERM)
        summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drained on stop")]
        assert len(summary) == 1, summary
        line = summary[0]
        assert "0 abandoned" in line and "4 results published since start" in line, line
        assert "offsets committed: " in line and f"{k.jobs_topic}:" in line, line
    finally:
        broker.stop()
        svc.close()


async def test_worker_stopped_while_waiting_for_its_broker_exits_cleanly(tmp_path, demo_set, cpu_engine, ledger_url, caplog):
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    s = load_settings(None, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}", "engine.model_dir": str(demo_set["model"]),
                             "engine.device": "cpu", "engine.max_new_tokens": 32, "engine.max_prompt_tokens": 200,
                             "worker.spool_path": str(tmp_path / "spool.sqlite"), "ledger.url": ledger_url})
    svc = open_services(s)
    try:
        async with running_worker(s, svc, cpu_engine) as rw:
            await asyncio.sleep(0.3)
            rw.worker.stop()
            await asyncio.wait_for(rw.task, 10)
        assert any("stopped while waiting for the broker" in r.getMessage() for r in caplog.records)
    finally:
        svc.close()


async def test_the_ledger_is_waited_for_until_its_schema_exists(tmp_path, caplog):
    """A worker started before `lorabatch db upgrade`: it waits, saying to run it, and opens once it has run."""
    from billing.db import upgrade
    from consumer.waits import wait_for_ledger
    from migrations import SCRIPT_LOCATION

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    s = load_settings(None, {"ledger.url": url, "worker.wait_max_s": 0.2, "store.adapter_dir": str(tmp_path / "store")})
    task = asyncio.create_task(wait_for_ledger(s))
    await asyncio.sleep(1.0)
    assert not task.done()
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for the ledger database")]
    assert waits and all("SchemaMissing" in m and "lorabatch db upgrade" in m for m in waits), waits
    await asyncio.to_thread(lambda: upgrade(url, script_location=SCRIPT_LOCATION))
    svc = await asyncio.wait_for(task, 10)
    try:
        assert svc.registry.list_tenants() == []
    finally:
        svc.close()


async def test_the_ledger_password_is_not_logged_while_waiting(caplog):
    from consumer.waits import wait_for_ledger

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    s = load_settings(None, {"ledger.url": f"postgresql+psycopg://lorabatch:hunter2-secret@127.0.0.1:{free_port()}/x",
                             "worker.wait_max_s": 0.1})
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(wait_for_ledger(s), 2.0)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "waiting for the ledger database" in text and "hunter2-secret" not in text and "***" in text


async def test_redis_is_waited_for_at_start_then_routing_goes_on_without_it(tmp_path, caplog):
    from consumer.route_cache import RedisRouteCache
    from consumer.waits import wait_for_redis
    from tests.service_fixtures import RedisServer

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    server = RedisServer(tmp_path)
    s = load_settings(None, {"routing.cache": "redis", "routing.redis_url": server.url.replace("redis://", "redis://:pw-secret@"),
                             "worker.wait_max_s": 0.2,
                             "routing.redis_start_wait_s": 0.6})
    cache = RedisRouteCache(server.url, 10, 60.0, timeout_s=0.2)
    try:
        await wait_for_redis(cache, s)  # nobody listens: gives up after ~0.6 s, and says how routing goes on
        text = [r.getMessage() for r in caplog.records]
        assert any(m.startswith(f"waiting for Redis at redis://127.0.0.1:{server.port}/0:") for m in text), text
        assert any("starting without Redis" in m for m in text) and not any("pw-secret" in m for m in text), text
        caplog.clear()
        s = s.model_copy(update={"routing": s.routing.model_copy(update={"redis_start_wait_s": 30.0})})
        task = asyncio.create_task(wait_for_redis(cache, s))
        await asyncio.sleep(0.5)
        assert not task.done()
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(task, 10)
        assert any("is available after" in r.getMessage() for r in caplog.records)
    finally:
        await cache.close()
        server.stop()


def test_a_failing_registry_refresh_logs_its_traceback_once_then_a_line_a_minute(caplog):
    """The ledger database away: the worker's registry refresh (every worker.registry_refresh_s) logs its first failure
    with the traceback, then one line a minute while it keeps failing, and one when it works again (an operator saw a
    full traceback every 5 s during an outage). consumer.logs.Outage keeps the streak; the clock is the test's."""
    from types import SimpleNamespace

    from consumer.ledger_calls import LedgerCalls
    from consumer.logs import Outage, Throttle
    from consumer.worker import Worker

    clock = [1000.0]
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    failing = [True]

    def snapshot():
        if failing[0]:
            raise ConnectionRefusedError("connection refused")
        return "snap"

    applied = []
    outage = Outage("registry refresh", logging.getLogger("lorabatch.worker"), "routing on the previous snapshot",
                    clock=lambda: clock[0])  # fmt: skip
    stub = SimpleNamespace(s=SimpleNamespace(worker=SimpleNamespace(registry_refresh_s=0.0)), _snapshot_at=0.0,
                           _registry_outage=outage, registry=SimpleNamespace(snapshot=snapshot), _apply_snapshot=applied.append,
                           ledger_calls=LedgerCalls())
    for _ in range(24):  # two minutes of refreshes every 5 s
        asyncio.run(Worker._refresh_registry(stub))
        clock[0] += 5.0
    failing[0] = False
    asyncio.run(Worker._refresh_registry(stub))
    msgs = [(r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert msgs[0] == ("ERROR", "registry refresh failed; routing on the previous snapshot", True)
    still = [m for m in msgs if m[1].startswith("registry refresh still failing")]
    assert [m[1] for m in still] == ["registry refresh still failing after 60 s (ConnectionRefusedError: connection refused); "
                                     "routing on the previous snapshot"] and not still[0][2], msgs
    assert msgs[-1][1] == "registry refresh works again after 120 s" and applied == ["snap"] and len(msgs) == 3, msgs
    t = Throttle(30.0, clock=lambda: clock[0])
    assert t.due() and not t.due()
    clock[0] += 30.0
    assert t.due()


@pytest.mark.slow
@ONE_LEDGER
async def test_a_join_held_by_a_worker_that_left_names_it(broker, tmp_path, demo_set, cpu_engine, ledger_url, caplog, monkeypatch):
    """The only worker of a group, started with --worker-id (static membership), stops; a worker under another id then
    joins the group. The embedded broker never expires the static member that left, so the join waits until a worker
    with that id comes back: the "still waiting" lines name the group's members (the gone worker's id among them) and
    the way out, where they said only that a dead member holds the group until its session times out, long past."""
    import consumer.waits as waits
    from tests.service_fixtures import service_settings

    monkeypatch.setattr(waits, "SLOW_ATTEMPT_S", 2.0)
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"worker.worker_id": "first-of-two"})
    svc = open_services(s)
    try:
        async with running_worker(s, svc, cpu_engine) as rw:
            while not any(r.getMessage().startswith("assigned [") for r in caplog.records):
                assert not rw.task.done(), rw.task
                await asyncio.sleep(0.1)
        second = s.model_copy(update={"worker": s.worker.model_copy(update={"worker_id": "second-of-two"})})
        before = len(caplog.records)
        async with running_worker(second, svc, cpu_engine) as rw:
            while not any(r.getMessage().startswith(("still waiting for the Kafka", "assigned [")) for r in caplog.records[before:]):
                await asyncio.sleep(0.1)
    finally:
        svc.close()
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("still waiting for the Kafka")]
    assert said and f"group {s.kafka.group_id} is " in said[0] and "first-of-two-" in said[0], said
    assert "start one, or restart the broker" in said[0], said


def test_the_drain_summary_counts_partitions_revoked_during_the_stop(caplog):
    """A rebalance during the drain forgets the revoked partitions' offsets: the summary still counts their pending
    jobs as abandoned and lists what the worker committed there (a SIGTERMed worker among three, its partitions
    revoked as another joined, logged '64 finished, 0 abandoned ... offsets committed: none' after leaving 32 jobs
    and committing both partitions)."""
    from types import SimpleNamespace

    from aiokafka import TopicPartition

    from consumer.metrics import WorkerMetrics
    from consumer.offsets import OffsetTracker
    from consumer.worker import Worker

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    p0, p3 = TopicPartition("jobs", 0), TopicPartition("jobs", 3)
    w = Worker.__new__(Worker)  # the summary needs the offsets, the stop's marks and the deliverer's counts only
    w.offsets, w._stopping, w._in_flight_at_stop = OffsetTracker(), asyncio.Event(), None
    w.deliverer, w.spool = SimpleNamespace(published=5, spooled=0, stopping=False), SimpleNamespace(known=0)
    w._work_event, w.metrics = asyncio.Event(), WorkerMetrics()
    for tp in (p0, p3):
        for o in range(4):
            w.offsets.fetched(tp, o)
    w.offsets.finished(p3, 0)
    w.offsets.mark_committed(w.offsets.committable())  # jobs:3=1
    w.stop()  # 7 in flight
    for o in (1, 2, 3):
        w.offsets.finished(p3, o)
    w.offsets.finished(p0, 0)
    w.offsets.mark_committed(w.offsets.committable())  # jobs:0=1, jobs:3=4
    w.offsets.forget([p0, p3])  # the rebalance's revoke: p0's 3 pending jobs go to the next owner
    w._log_summary()
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drained on stop")]
    assert "7 jobs in flight at the stop, 4 finished, 3 abandoned" in line, line
    assert line.endswith("offsets committed: jobs:0=1, jobs:3=4"), line


async def test_records_fetched_as_the_stop_came_are_left_to_the_next_owner():
    """A SIGTERM that lands while a fetch waits (a rebalance holds it) stops the worker; the records that fetch brings
    back are left uncommitted for the partitions' next owner. They were taken in and then left, and the summary read
    '0 jobs in flight at the stop, 0 finished, 112 abandoned'."""
    from types import SimpleNamespace

    from consumer.metrics import WorkerMetrics
    from consumer.offsets import OffsetTracker
    from consumer.worker import Worker

    w = Worker.__new__(Worker)
    w.offsets, w._stopping, w._in_flight_at_stop, w.deliverer = OffsetTracker(), asyncio.Event(), None, None
    w._work_event, w.metrics = asyncio.Event(), WorkerMetrics()
    ingested = []

    async def getmany(**_):
        w.stop()  # the SIGTERM, while the broker held the fetch
        return {"jobs-0": [SimpleNamespace(offset=o) for o in range(112)]}

    async def ingest(items, fetched_ns):
        ingested.extend(items)

    w._backpressure = lambda: None
    w.consumer = SimpleNamespace(getmany=getmany)
    w.intake = SimpleNamespace(ingest=ingest)
    await asyncio.wait_for(w._fetch_loop(), 5)
    assert ingested == [] and w.offsets.in_flight() == 0


async def test_redis_refusing_the_password_at_start_is_said_at_once(redis_server, caplog):
    """Redis with a password the worker lacks (NOAUTH) or a wrong one (WRONGPASS): the worker retried for
    routing.redis_start_wait_s (30 s), holding every job, each line saying "start it", which cannot help. Now one
    error line names routing.redis_url and the password, and the worker starts routing without Redis."""
    import redis as sync_redis

    from consumer.route_cache import RedisRouteCache
    from consumer.waits import wait_for_redis

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    admin = sync_redis.Redis.from_url(redis_server.url)
    admin.config_set("requirepass", "s3cret")
    try:
        for url, said in ((redis_server.url, "Redis requires a password: put it in routing.redis_url"),
                          (redis_server.url.replace("redis://", "redis://:wrong-pw@"), "refuses the user or password")):
            caplog.clear()
            s = load_settings(None, {"routing.cache": "redis", "routing.redis_url": url, "worker.wait_max_s": 0.2,
                                     "routing.redis_start_wait_s": 1.0})
            cache = RedisRouteCache(url, 10, 60.0, timeout_s=0.2)
            try:
                await wait_for_redis(cache, s)
            finally:
                await cache.close()
            text = [r.getMessage() for r in caplog.records]
            assert not any(m.startswith("waiting for Redis") for m in text), text  # no retries
            assert any("refuses the worker" in m and said in m for m in text) and not any("wrong-pw" in m for m in text), text
    finally:
        sync_redis.Redis.from_url(redis_server.url.replace("redis://", "redis://:s3cret@")).config_set("requirepass", "")
        admin.close()
