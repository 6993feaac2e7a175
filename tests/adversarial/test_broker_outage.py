"""A bad day with the broker, beyond a reset (test_broker_restart.py): the broker dead under a running worker
that is then told to stop. Nothing the broker did not take may be billed, and the stop must end in a time an
orchestrator's grace period allows, cleanly, with its summary line."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

import pytest

from billing import db
from consumer.broker import EmbeddedBroker, free_port
from migrations import SCRIPT_LOCATION
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@contextlib.asynccontextmanager
async def _own_broker(tmp_path, demo_set, pg_database, **extra):
    """A broker process of the test's own (it is killed), a migrated ledger schema, two tenants: (broker, settings, services)."""
    broker = EmbeddedBroker(free_port(), log_path=tmp_path / "tansu.log")
    await asyncio.to_thread(broker.start, [], 1)
    try:
        with fresh_pg_schema(pg_database) as url:
            db.upgrade(url, script_location=SCRIPT_LOCATION)
            s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **extra)
            svc = open_services(s)
            try:
                register_two_tenants(svc, demo_set)
                yield broker, s, svc
            finally:
                svc.close()
    finally:
        if broker.process is not None and broker.process.poll() is None:
            broker.process.send_signal(signal.SIGCONT)  # a frozen broker would not take its SIGTERM
        broker.stop()


@pytest.mark.parametrize("outage", ["killed", "frozen"])
async def test_a_stop_with_the_broker_dead_exits_cleanly_billing_only_what_was_published(outage, tmp_path, demo_set,
                                                                                         pg_database, caplog):
    """The broker is killed (or frozen: SIGSTOP) while the worker has a queue; the worker is then stopped. It ends by
    itself, without an exception, well within a 30 s grace period (deadlines of 1 s), and writes its summary line;
    every ledger row is of a result the broker acknowledged (rows == results published), and the jobs whose results
    it could not publish are left unbilled and uncommitted."""
    caplog.set_level(logging.INFO, "lorabatch.worker")
    jobs = [{"request_id": f"dead-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"job {i} " * 8,
             "max_new_tokens": 24} for i in range(48)]
    async with _own_broker(tmp_path, demo_set, pg_database, **{"worker.stop_deadline_s": 1.0,
                                                                "worker.revoke_deadline_s": 1.0}) as (broker, s, svc):
        async with live_worker(s, svc) as lw:
            async with Collector(s) as col:
                sent = await produce(s, [job_message(j) for j in jobs])
                assert await col.until(lambda c: len(c.results) >= 4 or not lw.alive(), 60), lw.death()
            if outage == "killed":
                broker.process.kill()
                broker.process.wait(10)
            else:
                broker.process.send_signal(signal.SIGSTOP)
            await asyncio.sleep(1.0)  # the engine answers more jobs into an outbox the broker no longer takes
            loop = asyncio.get_running_loop()
            asked = loop.time()
            lw.worker.stop()
            done, _ = await asyncio.wait({lw.task}, timeout=60)
            took = loop.time() - asked
            if outage == "frozen":
                broker.process.send_signal(signal.SIGCONT)
            assert done, "the worker did not stop within 60 s of the stop with the broker dead"
            assert lw.task.exception() is None, lw.death()
            published = lw.worker.deliverer.published
        rows = svc.ledger.count_usage()
    assert took < 30, f"the stop took {took:.0f} s with the broker dead, past a 30 s grace period"
    assert rows == published < len(sent), (rows, published, len(sent))
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drained on stop")]
    assert summary and "abandoned" in summary[0], summary
