"""The Redis route cache: one round trip per batch, bounded per tenant, expiring, and never blocking
routing when Redis is away."""

from __future__ import annotations

import asyncio

from consumer.route_cache import CacheKey, RedisRouteCache


async def test_get_set_and_bound(redis_server):
    """Writes land, reads come back in one MGET, and each tenant's keys of a level are trimmed to the bound."""
    cache = RedisRouteCache(redis_server.url, max_entries=3, ttl_s=60)
    try:
        keys = [CacheKey("l2", "acme", f"s{i}") for i in range(5)]
        for i, k in enumerate(keys):
            assert await cache.set_many({k: f"a@{i}"})
        got = await cache.get_many(keys + [CacheKey("l2", "globex", "s0")])
        assert got == {keys[2]: "a@2", keys[3]: "a@3", keys[4]: "a@4"}  # the two oldest were trimmed
    finally:
        await cache.close()


async def test_entries_expire(redis_server):
    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=0.2)
    try:
        k = CacheKey("l1", "acme", "u1")
        await cache.set_many({k: "x@1"})
        assert await cache.get_many([k]) == {k: "x@1"}
        await asyncio.sleep(0.3)
        assert await cache.get_many([k]) == {}
    finally:
        await cache.close()


async def test_redis_down_answers_unavailable_then_recovers(redis_server):
    """A dead Redis costs one short timeout, then lookups answer None at once until the backoff ends."""
    now = [0.0]
    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=60, timeout_s=0.05, backoff_s=1.0, clock=lambda: now[0])
    try:
        k = CacheKey("l1", "acme", "u1")
        await cache.set_many({k: "x@1"})
        redis_server.stop()
        assert await cache.get_many([k]) is None
        assert cache.errors == 1
        assert await cache.get_many([k]) is None and cache.errors == 1  # within the backoff: not even tried
        assert await cache.set_many({k: "y@1"}) is False
        redis_server.start()
        now[0] = 2.0
        assert await cache.get_many([k]) == {}  # a fresh server (nothing persisted), but answering again
        assert await cache.set_many({k: "y@1"}) and await cache.get_many([k]) == {k: "y@1"}
    finally:
        await cache.close()
