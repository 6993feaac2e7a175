"""The worker with its engine in a process of its own (worker.engine_process): the same service, and a crashed engine
process replaced while the worker goes on."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from datetime import UTC, datetime

import pytest

from billing.conservation import period_conservation
from billing.reconcile import reconcile_report
from consumer.schemas import Job
from consumer.submit import produce_jobs
from engine.config import EngineConfig
from engine.engine_process import EngineProcess
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import (Result, committed_vs_end, ledger_rows, open_services, read_all, running_worker,
                                   service_settings)

pytestmark = pytest.mark.slow


def _register(svc, demo_set) -> None:
    names = sorted(demo_set["adapters"])
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][names[0]], default=True)
    svc.registry.add_adapter("acme", "legal", demo_set["adapters"][names[1]])


def _jobs(prefix: str, n: int, max_new_tokens: int) -> list[Job]:
    return [Job(request_id=f"{prefix}{i}", tenant_id="acme", prompt=f"question {i} of {prefix}", max_new_tokens=max_new_tokens,
                adapter="legal" if i % 2 else None) for i in range(n)]  # fmt: skip


def _engine(demo_set, **config) -> EngineProcess:
    p = EngineProcess(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_new_tokens=32, max_prompt_tokens=200, **config))
    p.start()
    return p


async def _conserved(svc, s) -> object:
    """The period's conservation once the last busy record is written (every worker.ledger_flush_ms): some busy time,
    all of it attributed or named unbilled (nothing at all, before the first record, balances too)."""
    period = datetime.now(UTC).strftime("%Y-%m")
    deadline = time.monotonic() + 15
    while (((c := period_conservation(svc.db, period, s.ledger)).busy_us == 0 or c.attributed_us + c.unbilled_us != c.busy_us)
           and time.monotonic() < deadline):
        await asyncio.sleep(0.1)
    return c


@ONE_LEDGER
async def test_jobs_through_an_engine_process_are_answered_billed_and_committed(broker, tmp_path, demo_set, ledger_url):
    """Results, one ledger row each with its measured base time, busy time equal to what was attributed (the child's
    step records travel with its results), adapter loads billed, every offset committed."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"])
    svc = open_services(s)
    _register(svc, demo_set)
    jobs = _jobs("p", 12, 6)
    engine = _engine(demo_set)
    async with running_worker(s, svc, engine) as rw:
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(jobs))
        assert sorted(r.request_id for r in results) == sorted(j.request_id for j in jobs)
        assert all(r.status == "succeeded" and r.cost.base_ms > 0 and 1 <= r.usage.output_tokens <= 6 for r in results)
        assert {r.adapter for r in results} == {"support@1", "legal@1"}
        c = await _conserved(svc, s)
        assert c.busy_us > 0 and c.attributed_us == c.busy_us, c
        assert c.load_us > 0 and c.cold_start_us == c.load_us, c
        assert await ledger_rows(svc, len(jobs)) == len(jobs)
        await rw.stop()
    assert not engine.alive, "the worker closes its engine process when it stops"
    committed, end = await committed_vs_end(s)
    assert committed == end
    svc.close()


@ONE_LEDGER
async def test_a_crashed_engine_process_is_replaced_and_the_worker_goes_on(broker, tmp_path, demo_set, ledger_url):
    """SIGKILL of the engine child mid-batch: the jobs it was running are answered `engine_failed` (retriable), so a
    job that crashes the engine cannot crash it again on redelivery; the worker starts another child (the restart
    counter says so), registers its adapters again on first use, serves the next jobs, bills each job once, and
    never bills more GPU time than the ledger's busy records hold."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"])
    svc = open_services(s)
    _register(svc, demo_set)
    engine = _engine(demo_set)
    first_pid = engine.pid
    first, second = _jobs("a", 16, 32), _jobs("b", 8, 4)
    async with running_worker(s, svc, engine) as rw:
        await produce_jobs(s.kafka, first, "b1", "acme", "test", "request")
        while (st := await engine.stats())["running"] == 0 or st["steps"] < 2:  # a pass of theirs reported: busy time
            await asyncio.sleep(0.01)
        os.kill(first_pid, signal.SIGKILL)
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(first))
        failed = [r for r in results if r.status == "failed"]
        assert failed, "the kill came while jobs ran"
        assert all(r.error.code == "engine_failed" and r.error.retriable for r in failed), failed[0].error
        for _ in range(600):
            if engine.alive and engine.pid != first_pid:
                break
            await asyncio.sleep(0.05)
        assert engine.alive and engine.pid != first_pid
        assert rw.worker.metrics.engine_restarts._value.get() == 1
        await produce_jobs(s.kafka, second, "b2", "acme", "test", "request")
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(first) + len(second))
        later = [r for r in results if r.request_id.startswith("b")]
        assert len(later) == len(second) and all(r.status == "succeeded" for r in later), [r.error for r in later]
        assert {r.adapter for r in later} == {"support@1", "legal@1"}  # registered again in the new child
        assert not rw.task.done()
        assert await ledger_rows(svc, len(first) + len(second)) == len(first) + len(second)
        assert all(svc.ledger.usage_for("acme", r.request_id).base_us == 0 for r in failed), "the crash is charged to nobody"
        # The time the dead child's unanswered jobs took in the steps it reported: busy, billed to nobody, and named so
        # on a busy record (reconcile's unbilled work): every measured µs is billed or named, none unexplained.
        c = await _conserved(svc, s)
        assert c.unbilled_us > 0 and c.attributed_us + c.unbilled_us == c.busy_us, c
        period = datetime.now(UTC).strftime("%Y-%m")
        report = reconcile_report(svc.db, period, s.ledger)
        assert report.us("unbilled_work") == c.unbilled_us and report.us("unexplained_busy") == 0, report.lines
        await rw.stop()
    committed, end = await committed_vs_end(s)
    assert committed == end
    svc.close()


def _hang(engine) -> None:
    """Run in the engine child as a command: it answers nothing more, as a child stuck in a hung GPU call would."""
    time.sleep(3600)


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the stall is the worker's: one ledger is enough
async def test_a_hung_engine_process_is_killed_and_replaced(broker, tmp_path, demo_set, ledger_url):
    """A child that answers nothing for worker.engine_stall_s is killed and replaced as after a crash: its jobs in flight
    are answered engine_failed (retriable), the stall and the restart are counted, later jobs are served and billed."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"],
                               **{"worker.engine_stall_s": 3.0, "worker.ledger_flush_ms": 200})
    svc = open_services(s)
    _register(svc, demo_set)
    engine = _engine(demo_set)
    first_pid = engine.pid
    first, second = _jobs("h", 6, 32), _jobs("i", 4, 4)
    async with running_worker(s, svc, engine) as rw:
        await produce_jobs(s.kafka, first, "b1", "acme", "test", "request")
        while (await engine.stats())["running"] == 0:
            await asyncio.sleep(0.01)
        hung = asyncio.create_task(engine.call(_hang))
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(first), timeout_s=60)
        assert {r.error.code for r in results if r.status == "failed"} == {"engine_failed"}
        assert all(r.error.retriable for r in results if r.status == "failed")
        assert await asyncio.gather(hung, return_exceptions=True) != [None], "the hung command fails with its child"
        for _ in range(600):
            if engine.alive and engine.pid != first_pid:
                break
            await asyncio.sleep(0.05)
        assert engine.alive and engine.pid != first_pid
        m = rw.worker.metrics
        assert m.engine_stalls._value.get() >= 1 and m.engine_restarts._value.get() >= 1  # (a slow restart may stall again)
        await produce_jobs(s.kafka, second, "b2", "acme", "test", "request")
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(first) + len(second))
        assert all(r.status == "succeeded" for r in results if r.request_id.startswith("i"))
        assert await ledger_rows(svc, len(first) + len(second)) == len(first) + len(second)
        await rw.stop()
    committed, end = await committed_vs_end(s)
    assert committed == end
    svc.close()


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)  # the deadline is the worker's: one ledger is enough
async def test_a_stop_leaves_a_deep_queue_to_the_next_owner_within_its_deadline(broker, tmp_path, demo_set, ledger_url, caplog):
    """SIGTERM with jobs queued behind a busy engine: the queue keeps running for worker.stop_deadline_s, then the rest
    is left uncommitted (running jobs get worker.revoke_deadline_s, then are aborted), and the worker exits within
    those bounds, not after the whole queue. Nothing is lost: every job is answered or sits at or past its partition's
    committed offset, where the partition's next owner reads it again."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"],
                               **{"worker.stop_deadline_s": 0.01, "worker.revoke_deadline_s": 1.0, "worker.max_batch_size": 4})
    svc = open_services(s)
    _register(svc, demo_set)
    jobs = _jobs("q", 24, 8)
    async with running_worker(s, svc, _engine(demo_set, max_batch_size=4)) as rw:  # 4 running, 4 waiting in it, 16 queued
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        deadline = time.monotonic() + 60
        while len(rw.worker.scheduler) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert len(rw.worker.scheduler) > 0, "no queue formed behind the engine"
        with caplog.at_level("WARNING", "lorabatch.worker"):
            t0 = time.monotonic()
            await rw.stop()
            took = time.monotonic() - t0
    assert took < 20, f"the stop took {took:.1f} s: it ran the queue instead of leaving it"
    assert "leaving them to the partitions' next owner" in caplog.text
    committed, _ = await committed_vs_end(s)
    billed = svc.ledger.count_usage()
    answered = {r.request_id for r in await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= billed, timeout_s=10)}
    placed = await _placed(s)
    left = {rid for rid in placed if rid not in answered}
    assert left, "the stop left part of the queue"
    assert all(placed[rid][1] >= (committed.get(placed[rid][0]) or 0) for rid in left), (committed, sorted(placed[r] for r in left))
    assert billed == len(answered)
    svc.close()


async def _placed(s) -> dict[str, tuple[int, int]]:
    """request id -> (partition, offset) of every job on the jobs topic (keyed by request id)."""
    from aiokafka import TopicPartition

    from consumer.kafka import make_consumer

    c = make_consumer(s.kafka, group_id=None)
    await c.start()
    try:
        tps = [TopicPartition(s.kafka.jobs_topic, p) for p in sorted(c.partitions_for_topic(s.kafka.jobs_topic) or ())]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        out: dict[str, tuple[int, int]] = {}
        while batches := await c.getmany(*tps, timeout_ms=500):
            for tp, messages in batches.items():
                out.update({m.key.decode(): (tp.partition, m.offset) for m in messages if m.key})
        return out
    finally:
        await c.stop()
