"""Scenarios 4 and 5, the ledger away: PostgreSQL stopped and started mid-run, and the ledger's schema
dropped under a running worker. DESIGN.md, "Reliability and security": results go out once,
usage/busy/load records wait in a bounded durable local spool (worker.spool_path), nothing is dropped or
dead-lettered for it; once the ledger is back, every job has exactly one row and busy == attributed.

Both run on a PostgreSQL cluster of this module's own (tests/adversarial/pg_cluster.py), so stopping it
disturbs no other test.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from billing import db
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import account, close_scenario, wait_conserved, wait_rows
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _jobs(tag: str, n: int, new_tokens: int = 3) -> list[dict]:
    return [{"request_id": f"{tag}-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": f"{tag} job {i}",
             "max_new_tokens": new_tokens} for i in range(n)]


async def _spooling_worker_settings(broker, tmp_path, url, demo_set):
    return await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{
        "worker.spool_path": str(tmp_path / "spool.sqlite"), "worker.spool_max_records": 10_000,
        "worker.registry_refresh_s": 0.5})


async def test_postgres_stopped_and_started_mid_run(tally, broker, tmp_path, demo_set, own_pg):
    """PostgreSQL is stopped (fast shutdown) while jobs flow and more are produced while it is down:
    every job's result is published exactly once while it is down (no republish storm on the ledger's
    retries), nothing is dead-lettered, the worker stays alive; once it is started again, every job has
    exactly one ledger row with its usage and the worker's busy time equals its attributed time."""
    url = own_pg.new_database()
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await _spooling_worker_settings(broker, tmp_path, url, demo_set)
    svc = open_services(s)
    register_two_tenants(svc, demo_set)
    down_since = None
    try:
        async with live_worker(s, svc) as lw, Collector(s) as col:
            warm = await produce(s, [job_message(j) for j in _jobs("warm", 6)])
            await col.until(lambda c: c.answered(warm) or not lw.alive(), 60)

            flowing = await produce(s, [job_message(j) for j in _jobs("flowing", 24, new_tokens=8)])
            await asyncio.to_thread(own_pg.stop)
            down_since = time.monotonic()
            down = await produce(s, [job_message(j) for j in _jobs("down", 12)])
            sent = warm + flowing + down
            answered_while_down = await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
            await col.settle(2.0)  # a republish on the ledger's retries would show here
            published_while_down = len(col.results)
            alive_while_down = lw.alive()
            await asyncio.to_thread(own_pg.start)
            down_s = time.monotonic() - down_since

            await col.until(lambda c: c.answered(sent) or not lw.alive(), 30)
            await col.settle(2.0)
            end = await close_scenario(tally, sent, col, svc.db, lw, rows_s=60, busy_s=30)
            tally.note(f"PostgreSQL down {down_s:.1f}s; {published_while_down} results published while down")
    finally:
        svc.close()
    acct = end.acct
    assert alive_while_down, "the worker died while the ledger was down"
    assert not end.problems(), end.problems()[:20]
    assert answered_while_down, (f"only {published_while_down} of {len(sent)} results were published while the ledger was down; "
                                 "results must go out while ledger records wait in the spool")
    assert not col.dlq, [(d.error.code, d.error.message[:200]) for d, _ in col.dlq]
    assert all(r.status == "succeeded" for rs in acct.results.values() for r in rs), [r.error for rs in acct.results.values() for r in rs]


async def test_ledger_schema_dropped_under_a_running_worker(tally, broker, tmp_path, demo_set, own_pg):
    """The ledger's schema is dropped (DROP SCHEMA public CASCADE) under a running worker and jobs keep
    coming: their results are published once, nothing goes to the DLQ with a ledger error, the worker
    stays alive; after re-migrating (billing.db.upgrade), the spooled records land: one row each, and the
    busy records that wait with them equal the time attributed to those rows."""
    url = own_pg.new_database()
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await _spooling_worker_settings(broker, tmp_path, url, demo_set)
    svc = open_services(s)
    register_two_tenants(svc, demo_set)
    try:
        async with live_worker(s, svc) as lw, Collector(s) as col:
            warm = await produce(s, [job_message(j) for j in _jobs("warm", 6)])
            await col.until(lambda c: c.answered(warm) or not lw.alive(), 60)
            warm_rows = await wait_rows(svc.db, [m.identity for m in warm], 15)
            await wait_conserved(svc.db, lw.worker_id)  # the warm-up's busy time is in before the schema goes

            own_pg.execute(url, "SET lock_timeout = '20s'", "DROP SCHEMA public CASCADE", "CREATE SCHEMA public")
            during = await produce(s, [job_message(j) for j in _jobs("dropped", 16, new_tokens=6)])
            sent = warm + during
            answered_without_schema = await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
            await col.settle(2.0)
            published_without_schema = len(col.results)
            alive_without_schema = lw.alive()

            await asyncio.to_thread(db.upgrade, url, script_location=SCRIPT_LOCATION)
            register_two_tenants(svc, demo_set)  # the registry lived in the dropped schema too
            await col.settle(2.0)
            # The warm-up's rows went with the dropped schema: the ledger is judged on the jobs sent after it.
            end = await close_scenario(tally, sent, col, svc.db, lw, billed=[m.identity for m in during], rows_s=60, busy_s=30)
            tally.note(f"{published_without_schema} results published without a schema")
    finally:
        svc.close()
    acct = end.acct
    ledger_dlq = [(d.error.code, d.error.message[:200]) for d, _ in col.dlq if d.error.code.startswith("ledger")]
    assert all(warm_rows.values()), "the warm-up has its rows before the drop"
    assert alive_without_schema, "the worker died while the ledger had no schema"
    assert not ledger_dlq, f"dead-lettered for the ledger's schema: {ledger_dlq}"
    assert not col.dlq, [(d.error.code, d.error.message[:200]) for d, _ in col.dlq]
    assert not end.problems(), end.problems()[:20]
    assert answered_without_schema, f"only {published_without_schema} of {len(sent)} results were published without a schema"
    assert all(r.status == "succeeded" for rs in acct.results.values() for r in rs), [r.error for rs in acct.results.values() for r in rs]


async def test_full_spool_pauses_fetching_and_drops_nothing(tally, broker, tmp_path, demo_set, own_pg):
    """With the ledger down and its spool full (worker.spool_max_records), fetching pauses: jobs produced
    after the spool filled get no result while the ledger stays down; nothing is dropped: once the
    ledger is back, the spool drains, fetching resumes, every job is answered exactly once with one
    ledger row each and busy == attributed."""
    url = own_pg.new_database()
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{
        "worker.spool_path": str(tmp_path / "spool.sqlite"), "worker.spool_max_records": 5})
    svc = open_services(s)
    register_two_tenants(svc, demo_set)
    try:
        async with live_worker(s, svc) as lw, Collector(s) as col:
            warm = await produce(s, [job_message(j) for j in _jobs("warm", 4)])
            await col.until(lambda c: c.answered(warm) or not lw.alive(), 60)
            await wait_conserved(svc.db, lw.worker_id)
            await asyncio.to_thread(own_pg.stop)
            try:
                filling = await produce(s, [job_message(j) for j in _jobs("filling", 10)])
                await col.until(lambda c: c.answered(warm + filling) or not lw.alive(), 30)  # their records fill the spool
                await asyncio.sleep(1.0)
                paused = await produce(s, [job_message(j) for j in _jobs("paused", 10)])
                await col.settle(5.0)
                answered_while_full = sum(bool(account(paused, col).results.get(m.identity)) for m in paused)
                alive_while_full = lw.alive()
            finally:
                await asyncio.to_thread(own_pg.start)
            sent = warm + filling + paused
            await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
            await col.settle(2.0)
            end = await close_scenario(tally, sent, col, svc.db, lw, rows_s=60, busy_s=30)
            tally.note(f"{answered_while_full} of {len(paused)} jobs produced after the spool filled were answered while it was full")
    finally:
        svc.close()
    acct = end.acct
    assert alive_while_full, "the worker died while its spool was full"
    assert answered_while_full == 0, (f"{answered_while_full} of {len(paused)} jobs produced after the spool filled were "
                                      "fetched and answered: fetching must pause while the spool is full")
    assert not end.problems(), end.problems()[:20]
    assert not col.dlq, [(d.error.code, d.error.message[:200]) for d, _ in col.dlq]
    assert all(r.status == "succeeded" for rs in acct.results.values() for r in rs), [r.error for rs in acct.results.values() for r in rs]


async def test_postgres_paused_mid_run_then_a_stop_and_a_restart(tally, broker, tmp_path, demo_set, own_pg):
    """PostgreSQL paused (its processes frozen, as `docker pause` or a hung host: connections stay open and nothing
    answers, no error comes) while jobs flow: their results are still published, once each, the worker stays alive and
    says the ledger is down (lorabatch_ledger_up 0), its records wait in the spool; a SIGTERM while it is still paused
    drains and exits. Once PostgreSQL goes on, a worker started again under the same id flushes the spool: one ledger row
    per job and busy == attributed. (Before: the worker published nothing and logged nothing for as long as the database
    was paused, the ledger gauge at 1, its event loop held by the registry refresh.)"""
    url = own_pg.new_database()
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    s = await _spooling_worker_settings(broker, tmp_path, url, demo_set)
    svc = open_services(s)
    register_two_tenants(svc, demo_set)
    safety = threading.Timer(150, own_pg.resume)  # a worker that hangs on the paused server must not hang the test too
    try:
        async with Collector(s) as col:
            async with live_worker(s, svc) as lw:
                warm = await produce(s, [job_message(j) for j in _jobs("warm", 6)])
                await col.until(lambda c: c.answered(warm) or not lw.alive(), 60)
                await wait_conserved(svc.db, lw.worker_id)

                safety.start()
                own_pg.pause()
                paused = await produce(s, [job_message(j) for j in _jobs("paused", 12)])
                sent = warm + paused
                answered = await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
                answered_while_paused = answered and own_pg.paused
                await col.settle(1.0)
                alive_while_paused = lw.alive()
                ledger_up = lw.worker.metrics.ledger_up._value.get()
                await lw.stop(timeout_s=45)
                stopped_while_paused = own_pg.paused
            first_exit = lw.death()
            own_pg.resume()

            async with live_worker(s, svc) as again:  # the same id, so the same spool file
                end = await close_scenario(tally, sent, col, svc.db, again, rows_s=60, busy_s=30)
    finally:
        safety.cancel()
        own_pg.resume()
        svc.close()
    assert answered_while_paused, "results must go out while the ledger does not answer; its records wait in the spool"
    assert alive_while_paused and ledger_up == 0, (alive_while_paused, ledger_up)
    assert stopped_while_paused and first_exit == "returned", f"a SIGTERM while the ledger is paused drains and exits: {first_exit}"
    assert not end.problems(), end.problems()[:20]
    assert not col.dlq, [(d.error.code, d.error.message[:200]) for d, _ in col.dlq]
    assert all(r.status == "succeeded" for rs in end.acct.results.values() for r in rs), [r.error for rs in end.acct.results.values() for r in rs]
