"""Redis on a bad day, beyond stopped and frozen (test_redis_outage.py): flushed mid-run, at its maxmemory under
`noeviction` (writes answer OOM), turned into a read-only replica (READONLY), a password set while the worker runs
(NOAUTH once its connections are renewed). A Redis of the test's own and a real worker on the demo model: every job
is answered once and succeeds on its tenant's adapter, the ledger holds one row each, and the worker's log names what
to fix (it said only "the route cache (Redis) failed N times", and OOM and READONLY not even that)."""

from __future__ import annotations

import logging

import pytest
import redis

from billing import db
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import close_scenario
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import free_port, open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _wave(tag: str, n: int) -> list[dict]:
    return [{"request_id": f"{tag}-{i}", "tenant_id": ("acme", "globex")[i % 2], "user_id": f"u{i % 3}",
             "session_id": f"{tag}-s{i % 4}", "prompt": f"{tag} hello {i}", "max_new_tokens": 2} for i in range(n)]


def _password(r: redis.Redis) -> None:
    r.config_set("requirepass", "s3cret")
    r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # logged-in connections would go on


SCENARIOS = {  # what goes wrong, what undoes it, what the log must say (None: nothing fails)
    "flushall": (lambda r: r.flushall(), lambda r: None, None),
    "maxmemory_noeviction": (lambda r: (r.config_set("maxmemory-policy", "noeviction"), r.config_set("maxmemory", 1)),
                             lambda r: r.config_set("maxmemory", 0), "maxmemory"),
    "maxmemory_lru": (lambda r: (r.config_set("maxmemory-policy", "allkeys-lru"), r.config_set("maxmemory", 1)),
                      lambda r: r.config_set("maxmemory", 0), None),
    "read_only_replica": (lambda r: r.execute_command("REPLICAOF", "127.0.0.1", free_port()),
                          lambda r: r.execute_command("REPLICAOF", "NO", "ONE"), "read-only replica"),
    "password_mid_run": (_password, lambda r: r.config_set("requirepass", ""), "password: put it in routing.redis_url"),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
async def test_redis_bad_day(scenario, tally, broker, tmp_path, demo_set, pg_database, redis_server, caplog):
    """Each scenario mid-run, then undone: every job answered once, succeeded, on its own tenant's adapter (by the
    caches or the default: nothing mis-routed), one ledger row each, busy == attributed, and the log names the fix."""
    break_it, mend_it, said = SCENARIOS[scenario]
    caplog.set_level(logging.WARNING, logger="lorabatch.worker")
    admin = redis.Redis.from_url(redis_server.url)
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{
            "routing.cache": "redis", "routing.redis_url": redis_server.url, "routing.redis_backoff_s": 0.2})
        svc = open_services(s)
        refs = register_two_tenants(svc, demo_set)
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                before = await produce(s, [job_message(j) for j in _wave("before", 12)])
                await col.until(lambda c: c.answered(before) or not lw.alive(), 60)
                break_it(admin)
                during = await produce(s, [job_message(j) for j in _wave("during", 12)])
                await col.until(lambda c: c.answered(before + during) or not lw.alive(), 60)
                mend_it(redis.Redis.from_url(redis_server.url.replace("//", "//:s3cret@"))
                        if scenario == "password_mid_run" else admin)
                after = await produce(s, [job_message(j) for j in _wave("after", 12)])
                sent = before + during + after
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
                await col.settle(0.5)
                end = await close_scenario(tally, sent, col, svc.db, lw)
        finally:
            svc.close()
            admin.close()
    assert not end.problems(), end.problems()
    assert not col.dlq, [d.error for d, _ in col.dlq]
    results = [r for rs in end.acct.results.values() for r in rs]
    assert len(results) == 36 and all(r.status == "succeeded" for r in results), [(r.request_id, r.error) for r in results]
    assert all(r.adapter == refs[r.tenant_id] for r in results), [(r.request_id, r.adapter, r.route) for r in results]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the route cache (Redis) failed")]
    if said is not None:
        assert any(said in line for line in lines), lines
