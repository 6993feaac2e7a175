"""Routing fed garbage: what Redis holds under the route caches' keys (bytes that are not UTF-8, references that are not
`name@version`, an index key of another type) and rules stored before `routes add` checked them (an adapter reference
that is not one, a regex that backtracks exponentially). Each crashed or froze the worker (one routing error failed
the whole batch through a handler that raised in turn; the regex held the event loop and SIGTERM). Now every job is
answered once and succeeds by the tenant's default, the worker stays alive, and the ledger holds one row each."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
import redis

from billing import db
from billing.models import RouteRuleRow
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import close_scenario
from tests.adversarial.harness import Collector, adversarial_settings, job_message, live_worker, produce, register_two_tenants
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

PREFIX = "poisoned"


def _poison(url: str) -> None:
    r = redis.Redis.from_url(url)
    try:
        r.set(f"{PREFIX}:l1:acme:u-bin", b"\xff\xfe")  # not UTF-8
        r.set(f"{PREFIX}:l1:acme:u-ref", "support@x")  # not a reference
        r.set(f"{PREFIX}:l1:globex:u-ref", "chat@" + "9" * 5000)  # a version int() refuses
        r.set(f"{PREFIX}:l2:acme:s-big", "x" * 100_000)  # too long to be one
        r.set(f"{PREFIX}:index:l1:acme", "not a sorted set")  # written back to: WRONGTYPE
        r.hset(f"{PREFIX}:l2:globex:s-hash", "a", "b")  # a hash under a value key
    finally:
        r.close()


def _bad_rules(svc) -> None:
    """Rules as an older version (or a hand-written INSERT) could have stored them."""
    with svc.registry.sessions.begin() as s:
        now = datetime.now(UTC)
        s.add(RouteRuleRow(tenant_id="acme", kind="keyword", pattern="refund", adapter="support@x", position=0, created_at=now))
        s.add(RouteRuleRow(tenant_id="acme", kind="regex", pattern="(a|aa)+$", adapter="support", position=1, created_at=now))
        s.add(RouteRuleRow(tenant_id="globex", kind="regex", pattern="([", adapter="chat", position=0, created_at=now))


def _jobs(n: int) -> list[dict]:
    prompts = ["refund please", "a" * 40 + "!", "hello"]
    users = ["u-bin", "u-ref", None]
    sessions = ["s-big", "s-hash", None]
    return [{"request_id": f"p-{i}", "tenant_id": ("acme", "globex")[i % 2], "prompt": prompts[i % 3], "max_new_tokens": 2,
             **({"user_id": users[i % 3]} if users[i % 3] else {}), **({"session_id": sessions[(i // 3) % 3]} if sessions[(i // 3) % 3] else {})}
            for i in range(n)]  # fmt: skip


async def test_poisoned_cache_and_rules_route_by_the_defaults(tally, broker, tmp_path, demo_set, pg_database, redis_server):
    _poison(redis_server.url)
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{
            "routing.cache": "redis", "routing.redis_url": redis_server.url, "routing.redis_prefix": PREFIX})
        svc = open_services(s)
        refs = register_two_tenants(svc, demo_set)
        _bad_rules(svc)
        try:
            async with live_worker(s, svc) as lw, Collector(s) as col:
                sent = await produce(s, [job_message(j) for j in _jobs(18)])
                await col.until(lambda c: c.answered(sent) or not lw.alive(), 90)
                await col.settle(1.0)
                alive = lw.alive()
                end = await close_scenario(tally, sent, col, svc.db, lw)
        finally:
            svc.close()
    assert alive, "the worker died on poisoned routing"
    assert not end.problems(), end.problems()
    results = [r for rs in end.acct.results.values() for r in rs]
    assert len(results) == 18 and all(r.status == "succeeded" for r in results), [(r.request_id, r.error) for r in results]
    assert {r.adapter for r in results if r.tenant_id == "acme"} == {refs["acme"]}
    assert {r.adapter for r in results if r.tenant_id == "globex"} == {refs["globex"]}
