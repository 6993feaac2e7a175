"""Scenario 3, broker log reset: offset marks follow the log actually served (DESIGN.md, "Reliability and
security"). A memory-only broker restarted on the same port has lost its topics and committed offsets,
and a topic deleted and created again starts over at offset 0; either way the worker must answer the
new log from its start, not skip what lies below its old marks."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.structs import OffsetAndMetadata

from billing import db
from consumer.broker import EmbeddedBroker, ensure_topics, free_port
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import account, close_scenario, wait_conserved, wait_rows
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _copies(acct) -> dict:
    """The answers of each identity answered more than once: whether they are one body replayed."""
    return {i: [(r.status, r.text[:16], r.usage.output_tokens, r.worker_id) for r in rs] for i, rs in acct.results.items() if len(rs) > 1}


def _jobs(tag: str, n: int) -> list[dict]:
    return [{"request_id": f"{tag}-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"{tag} job {i}", "max_new_tokens": 2}
            for i in range(n)]


@contextlib.asynccontextmanager
async def _one_broker(tmp_path, demo_set, pg_database):
    """A fresh broker, a migrated ledger schema of the test's own and the services on them, two tenants registered:
    (settings, services); all closed after."""
    broker = EmbeddedBroker(free_port(), log_path=tmp_path / "tansu.log")
    await asyncio.to_thread(broker.start, [], 1)
    try:
        with fresh_pg_schema(pg_database) as url:
            db.upgrade(url, script_location=SCRIPT_LOCATION)
            s = await adversarial_settings(broker, tmp_path, url, demo_set["model"])
            svc = open_services(s)
            try:
                register_two_tenants(svc, demo_set)
                yield s, svc
            finally:
                svc.close()
    finally:
        broker.stop()


async def test_broker_restarted_empty_on_the_same_port(tally, tmp_path, demo_set, pg_database):
    """Jobs before a broker restart are answered; the broker is killed and a fresh one (no topics, no
    committed offsets) started on the same port with the topics recreated; every job produced to the
    new log (its offsets all below the worker's old marks) is answered once, the worker stays alive,
    and the ledger has one row per job with busy == attributed."""
    port = free_port()
    first = EmbeddedBroker(port, log_path=tmp_path / "tansu-1.log")
    await asyncio.to_thread(first.start, [], 1)  # start() runs its own event loop: off this one
    second = EmbeddedBroker(port, log_path=tmp_path / "tansu-2.log")
    try:
        with fresh_pg_schema(pg_database) as url:
            db.upgrade(url, script_location=SCRIPT_LOCATION)
            s = await adversarial_settings(first, tmp_path, url, demo_set["model"])
            k = s.kafka
            svc = open_services(s)
            register_two_tenants(svc, demo_set)
            before, after = _jobs("before", 24), _jobs("after", 8)  # 12 a partition before, 4 after: all below the marks
            try:
                async with live_worker(s, svc) as lw:
                    async with Collector(s) as col1:
                        sent1 = await produce(s, [job_message(j) for j in before])
                        await col1.until(lambda c: c.answered(sent1) or not lw.alive(), 60)
                        await col1.settle(0.5)
                    acct1 = account(sent1, col1)
                    rows1 = await wait_rows(svc.db, [m.identity for m in sent1], 15)
                    await wait_conserved(svc.db, lw.worker_id)  # everything flushed: nothing of it rides on the old broker

                    first.process.kill()
                    first.process.wait(10)
                    await asyncio.to_thread(second.start, [], 1)
                    await ensure_topics(second.bootstrap, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)

                    async with Collector(s) as col2:
                        sent2 = await produce(s, [job_message(j) for j in after])
                        await col2.until(lambda c: c.answered(sent2) or not lw.alive(), 120)
                        await col2.settle(1.0)
                    # The new log's messages, accounted by their reader; the ledger of both logs' jobs.
                    end = await close_scenario(tally, sent2, col2, svc.db, lw, billed=[m.identity for m in sent1 + sent2],
                                               earlier=acct1.results)
                    tally.lost += len(acct1.lost)
                    tally.published_twice += len(acct1.extra)
                    tally.cases = len(sent1) + len(sent2)
            finally:
                svc.close()
    finally:
        second.stop()
        first.stop()
    assert not acct1.lost and not acct1.extra, (acct1.lost, acct1.extra)
    assert all(r.status == "succeeded" for rs in acct1.results.values() for r in rs)
    assert all(rows1.values()), "the jobs before the restart have their rows"
    acct2 = end.acct
    assert not end.problems(), (f"{len(sent2)} jobs on the new log", end.problems(), _copies(acct2))
    assert all(r.status == "succeeded" for rs in acct2.results.values() for r in rs), [r.error for rs in acct2.results.values() for r in rs]
    assert not col2.dlq, [d.error for d, _ in col2.dlq]


async def test_jobs_topic_recreated_under_a_running_worker(tally, tmp_path, demo_set, pg_database):
    """The jobs topic is deleted and created again (an empty log, offsets from 0) on a broker that stays
    up, so the worker's group survives: every job produced to the new log is answered once, though its
    offsets are all below the worker's marks for the old log; one ledger row each, busy == attributed."""
    async with _one_broker(tmp_path, demo_set, pg_database) as (s, svc):
        k = s.kafka
        async with live_worker(s, svc) as lw, Collector(s) as col:
            sent1 = await produce(s, [job_message(j) for j in _jobs("old-log", 24)])
            await col.until(lambda c: c.answered(sent1) or not lw.alive(), 60)
            await wait_conserved(svc.db, lw.worker_id)
            await asyncio.sleep(0.5)  # its offsets committed

            admin = AIOKafkaAdminClient(bootstrap_servers=k.bootstrap_servers, request_timeout_ms=5000)
            await admin.start()
            try:
                await admin.delete_topics([k.jobs_topic])
            finally:
                await admin.close()
            await asyncio.sleep(1.0)
            await ensure_topics(k.bootstrap_servers, [k.jobs_topic], k.partitions)
            sent2 = await produce(s, [job_message(j) for j in _jobs("new-log", 8)])
            await col.until(lambda c: c.answered(sent1 + sent2) or not lw.alive(), 90)
            await col.settle(1.0)
            end = await close_scenario(tally, sent1 + sent2, col, svc.db, lw)
    acct = end.acct
    new = [m.describe() for m in sent2 if not acct.results.get(m.identity)]
    assert not new, f"{len(new)} of {len(sent2)} jobs on the recreated topic were never answered: {new}"
    assert not end.problems(), end.problems()
    assert all(r.status == "succeeded" for rs in acct.results.values() for r in rs), [r.error for rs in acct.results.values() for r in rs]
    assert not col.dlq, [d.error for d, _ in col.dlq]


async def test_a_committed_offset_past_the_logs_end_is_read_from_the_beginning(tally, tmp_path, demo_set, pg_database):
    """The group's committed offsets lie past the jobs log's end, as when a worker rejoining a restarted memory-only
    broker commits its marks of the old log into the new one (seen in an operator's drill: every fetch then answered
    nothing, with no error, and the new jobs were never read, by that worker or a restarted one). A worker starting on
    such a group reads each partition from its beginning: every job is answered once, one ledger row each."""
    async with _one_broker(tmp_path, demo_set, pg_database) as (s, svc):
        k = s.kafka
        await ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
        # Committed for the group without joining it (partitions assigned by hand), as an old member's last commit
        old = AIOKafkaConsumer(bootstrap_servers=k.bootstrap_servers, group_id=k.group_id, enable_auto_commit=False)
        await old.start()
        try:
            parts = [TopicPartition(k.jobs_topic, p) for p in range(k.partitions)]
            old.assign(parts)
            await old.commit({tp: OffsetAndMetadata(1313, "") for tp in parts})
            assert all([await old.committed(tp) == 1313 for tp in parts])
        finally:
            await old.stop()
        async with live_worker(s, svc) as lw, Collector(s) as col:
            sent = await produce(s, [job_message(j) for j in _jobs("past-end", 8)])
            await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
            await col.settle(0.5)
            end = await close_scenario(tally, sent, col, svc.db, lw)
            resets = lw.worker.metrics.log_resets._value.get()
    tally.cases = len(sent)
    missing = [m.describe() for m in sent if not end.acct.results.get(m.identity)]
    assert not missing, f"{len(missing)} of {len(sent)} jobs behind a committed offset past the log's end were never read"
    assert not end.problems(), end.problems()
    assert resets >= 1, "the reset is counted (lorabatch_log_resets_total)"
