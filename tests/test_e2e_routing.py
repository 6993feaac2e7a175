"""Routing through the real worker: Redis-backed sessions stick, and a Redis outage fails no job."""

from __future__ import annotations

import pytest

from consumer.schemas import Job, Result
from consumer.submit import produce_jobs
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import open_services, read_all, running_worker, service_settings

pytestmark = pytest.mark.slow


def _wave(tag: str, n: int) -> list[Job]:
    return [Job(request_id=f"{tag}-{i}", tenant_id="acme", session_id=f"s{i % 4}", user_id=f"u{i % 3}",
                prompt=f"hello {i}", max_new_tokens=2) for i in range(n)]


async def _until_routed_with_the_cache(s, limit: int = 40) -> int:
    """Probe jobs, one at a time (each answered before the next), until one is routed with the cache; how many ran."""
    for n in range(1, limit + 1):
        rid = f"probe-{n}"
        await produce_jobs(s.kafka, [Job(request_id=rid, tenant_id="acme", session_id="probe", prompt="hi", max_new_tokens=1)],
                           "b", "acme", "test", "tenant")  # fmt: skip
        got = await read_all(s, s.kafka.results_topic, Result, lambda got: any(r.request_id == rid for r in got))
        if any(r.request_id == rid and "cache unavailable" not in r.route for r in got):
            return n
    raise AssertionError(f"no job was routed with the cache in {limit} probes after Redis came back")


@ONE_LEDGER
async def test_redis_outage_mid_run_fails_no_job(broker, tmp_path, demo_set, cpu_engine, ledger_url, redis_server):
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"],
                               **{"routing.cache": "redis", "routing.redis_url": redis_server.url,
                                  "routing.redis_backoff_s": 0.2})
    svc = open_services(s)
    names = sorted(demo_set["adapters"])
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][names[0]], default=True)
    async with running_worker(s, svc, cpu_engine):
        await produce_jobs(s.kafka, _wave("before", 12), "b", "acme", "test", "tenant")
        before = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= 12)
        redis_server.stop()
        await produce_jobs(s.kafka, _wave("during", 12), "b", "acme", "test", "tenant")
        during = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= 24)
        redis_server.start()
        # The router tries Redis again once its backoff since the last error has passed (an error may still come from a
        # call under way at the restart): single probe jobs until one is routed with the cache, so that the wave after
        # does not race the backoff (under load the whole wave was once routed inside it).
        probes = await _until_routed_with_the_cache(s)
        await produce_jobs(s.kafka, _wave("after", 12), "b", "acme", "test", "tenant")
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= 36 + probes)
    by_wave: dict[str, list[Result]] = {}
    for r in results:
        by_wave.setdefault(r.request_id.split("-")[0], []).append(r)
    assert all(r.status == "succeeded" for r in results), [r.error for r in results if r.error]
    assert len(results) == 36 + probes and len(before) >= 12 and len(during) >= 24
    # Before: the first job of each session is routed by the default, the rest hit the session map.
    reasons = [r.route for r in by_wave["before"]]
    assert reasons.count("tenant_default") >= 4 and any(x.startswith("l2_session") for x in reasons), reasons
    # During the outage: routing went on without the cache and said so.
    assert all("cache unavailable" in r.route for r in by_wave["during"]), [r.route for r in by_wave["during"]]
    # After the restart (an empty Redis): sessions are written again, and later jobs hit them.
    assert any(r.route == "l2_session" for r in by_wave["after"]), [r.route for r in by_wave["after"]]
    svc.close()
