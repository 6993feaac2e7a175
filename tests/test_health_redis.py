"""/readyz while Redis dies and comes back under a serving worker (consumer.health, consumer.route_cache)."""

from __future__ import annotations

from types import SimpleNamespace

from consumer.config import load_settings
from consumer.metrics import WorkerMetrics
from consumer.registry import RegistrySnapshot
from consumer.route_cache import CacheKey, RedisRouteCache
from consumer.worker import Worker
from engine.config import EngineConfig


async def test_readyz_names_redis_while_it_fails_mid_run_and_forgets_it_once_back(redis_server):
    """Invariant: while the route cache's latest calls fail, /readyz stays ready and lists "redis" under degraded, with
    the error; the first call that succeeds again clears it. Before, only the wait at start set waiting{on="redis"}: a
    Redis that died under a serving worker left /readyz saying degraded [] while every routing lookup failed."""
    now = [0.0]
    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=60, timeout_s=0.05, backoff_s=1.0, clock=lambda: now[0])
    m = WorkerMetrics()
    m.health.phase = "serving"
    m.health.route_cache = cache
    k = CacheKey("l1", "acme", "u1")
    try:
        assert await cache.set_many({k: "x@1"})
        assert m.health.ready() == (True, {"ready": True, "phase": "serving", "engine": True, "degraded": []})
        redis_server.stop()
        assert await cache.get_many([k]) is None
        ok, body = m.health.ready()
        assert ok and body["degraded"] == ["redis"] and "routing goes on" in body["redis"], body
        now[0] = 2.0
        assert await cache.set_many({k: "y@1"}) is False  # a write fails as well: still named
        assert m.health.ready()[1]["degraded"] == ["redis"]
        redis_server.start()
        now[0] = 4.0
        assert await cache.get_many([k]) == {}  # reads answer: the cache serves again
        assert m.health.ready() == (True, {"ready": True, "phase": "serving", "engine": True, "degraded": []})
    finally:
        await cache.close()


async def test_the_worker_gives_its_route_cache_to_its_probes(tmp_path):
    """A worker built for routing.cache = "redis" hands that cache to /readyz: a Redis that answers nothing (a port no
    server listens on) is named there after one failed lookup."""
    s = load_settings(None, {"routing.cache": "redis", "routing.redis_url": "redis://127.0.0.1:1/12",
                             "worker.spool_path": str(tmp_path / "spool.sqlite")})
    w = Worker(s, SimpleNamespace(config=EngineConfig(max_batch_size=32)),
               SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=None), ledger=None)
    try:
        w.metrics.health.phase = "serving"
        assert await w.router.cache.get_many([CacheKey("l1", "acme", "u1")]) is None
        body = w.metrics.health.ready()[1]
        assert body["degraded"] == ["redis"] and "127.0.0.1:1" in body["redis"], body
    finally:
        await w.router.cache.close()
