"""Scenario 6, Redis away: routing goes on through L3 and defaults, the reason says so, nothing blocks
(DESIGN.md, "Routing"). A Redis of the test's own (tests/service_fixtures.py RedisServer) is stopped
while jobs flow, and frozen (SIGSTOP: connections open, no answers) in a second test."""

from __future__ import annotations

import logging
import signal

import pytest

from billing import db
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import close_scenario
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def _wave(tag: str, n: int) -> list[dict]:
    return [{"request_id": f"{tag}-{i}", "tenant_id": ("acme", "globex")[i % 2], "user_id": f"u{i % 3}",
             "session_id": f"s{i % 4}", "prompt": f"{tag} hello {i}", "max_new_tokens": 3} for i in range(n)]


async def _run(tally, broker, tmp_path, demo_set, pg_database, redis_server, outage, recover, caplog=None) -> None:
    if caplog is not None:
        caplog.set_level(logging.WARNING, logger="lorabatch.worker")
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{
            "routing.cache": "redis", "routing.redis_url": redis_server.url, "routing.redis_backoff_s": 0.2})
        svc = open_services(s)
        register_two_tenants(svc, demo_set)
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                before = await produce(s, [job_message(j) for j in _wave("before", 16)])
                outage()  # while the first wave is still being fetched and routed
                during = await produce(s, [job_message(j) for j in _wave("during", 16)])
                ok_during = await col.until(lambda c: c.answered(before + during) or not lw.alive(), 60)
                recover()
                after = await produce(s, [job_message(j) for j in _wave("after", 16)])
                sent = before + during + after
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 60)
                await col.settle(1.0)
                end = await close_scenario(tally, sent, col, svc.db, lw)
        finally:
            svc.close()
    assert not end.problems(), end.problems()
    assert ok_during, "jobs were not answered while Redis was away"
    assert not col.dlq, [d.error for d, _ in col.dlq]
    acct = end.acct
    failed = [(i, r.error) for i, rs in acct.results.items() for r in rs if r.status != "succeeded"]
    assert not failed, failed
    during_routes = [acct.results[m.identity][0].route for m in during]
    assert all("cache unavailable" in r for r in during_routes), f"routing during the outage must say so: {during_routes}"
    if caplog is not None:  # and the worker's log says it (an operator found only the metric)
        said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the route cache (Redis) failed")]
        assert said, "no log line while Redis was away"


async def test_redis_stopped_mid_run(tally, broker, tmp_path, demo_set, pg_database, redis_server, caplog):
    """Redis (routing.cache = "redis") is stopped while jobs flow and started again (empty): every job is
    answered once and succeeds, routing during the outage falls back and says "cache unavailable" (and the log
    says Redis failed), the worker stays alive, one ledger row each, busy == attributed."""
    await _run(tally, broker, tmp_path, demo_set, pg_database, redis_server, redis_server.stop, redis_server.start, caplog)


async def test_redis_frozen_mid_run(tally, broker, tmp_path, demo_set, pg_database, redis_server):
    """Redis frozen (SIGSTOP: its socket accepts, nothing answers) while jobs flow, then thawed: each call
    costs at most routing.redis_timeout_ms and then the backoff routes without it, so every job is
    answered once and succeeds, the worker stays alive, one ledger row each, busy == attributed."""
    proc = redis_server.proc
    try:
        await _run(tally, broker, tmp_path, demo_set, pg_database, redis_server,
                   lambda: proc.send_signal(signal.SIGSTOP), lambda: proc.send_signal(signal.SIGCONT))
    finally:
        proc.send_signal(signal.SIGCONT)
