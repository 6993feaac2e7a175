"""The Redis route cache: one round trip per batch, bounded per tenant, expiring, and never blocking
routing when Redis is away."""

from __future__ import annotations

import asyncio
import time

import pytest

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


async def test_values_that_are_no_reference_are_misses(redis_server):
    """Bytes that are not UTF-8, or a value too long to be an adapter reference, read as a miss (the client's own
    decoding raised for the whole batch); the counter says how many."""
    import redis as sync_redis

    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=60, prefix="bad")
    r = sync_redis.Redis.from_url(redis_server.url)
    try:
        r.set("bad:l1:acme:u1", b"\xff\xfe")
        r.set("bad:l1:acme:u2", "x" * 1000)
        r.set("bad:l1:acme:u3", "fine@1")
        keys = [CacheKey("l1", "acme", f"u{i}") for i in (1, 2, 3)]
        assert await cache.get_many(keys) == {keys[2]: "fine@1"}
        assert cache.bad_entries == 2 and cache.errors == 0
    finally:
        r.close()
        await cache.close()


async def test_an_index_of_another_type_is_rewritten_not_taken_for_redis_down(redis_server):
    """A tenant's index key holding a string (WRONGTYPE for its sorted-set commands) marked the whole cache down at every
    write, for every tenant. Now the write lands, the bad key is deleted and the next write makes the index afresh."""
    import redis as sync_redis

    cache = RedisRouteCache(redis_server.url, max_entries=2, ttl_s=60, prefix="wt")
    r = sync_redis.Redis.from_url(redis_server.url)
    try:
        r.set("wt:index:l1:acme", "not a sorted set")
        k = CacheKey("l1", "acme", "u1")
        assert await cache.set_many({k: "a@1", CacheKey("l1", "globex", "u1"): "b@1"}) is True
        assert cache.errors == 0 and cache.bad_entries == 1 and cache.available
        assert await cache.get_many([k]) == {k: "a@1"}
        for i in range(4):
            assert await cache.set_many({CacheKey("l1", "acme", f"v{i}"): f"a@{i}"})
        assert r.type("wt:index:l1:acme") == b"zset" and r.zcard("wt:index:l1:acme") == 2  # trimmed again
    finally:
        r.close()
        await cache.close()


async def _refusing_writes(redis_server, refuse, restore, said: str) -> None:
    import redis as sync_redis

    now = [0.0]
    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=60, backoff_s=1.0, clock=lambda: now[0])
    r = sync_redis.Redis.from_url(redis_server.url)
    k = CacheKey("l2", "acme", "s1")
    try:
        assert await cache.set_many({k: "a@1"})
        refuse(r)
        assert await cache.set_many({k: "a@2", CacheKey("l2", "acme", "s2"): "a@2"}) is False
        assert cache.errors == 1 and cache.bad_entries == 0, (cache.errors, cache.bad_entries)
        assert said in cache.last_error, cache.last_error
        assert r.type("lorabatch:route:index:l2:acme") == b"zset"  # the bound still tracks the keys written before
        assert await cache.get_many([k]) == {k: "a@1"}  # reads go on: the route still sticks
        assert await cache.set_many({k: "a@3"}) is False and cache.errors == 1  # within the backoff: not even tried
        restore(r)
        now[0] = 2.0
        assert await cache.set_many({k: "a@4"}) and await cache.get_many([k]) == {k: "a@4"}
    finally:
        r.close()
        await cache.close()


async def test_redis_at_maxmemory_noeviction_refuses_writes_not_data(redis_server):
    """Redis at its maxmemory under `noeviction` answers writes with OOM: that was taken for a key of another type, the
    tenant's index deleted at each write (the bound lost its keys) and counted as a bad entry, no error, nothing in the
    log. Now it is a cache error naming maxmemory, writes pause for the backoff, reads go on, the index stays."""
    def refuse(r):
        r.config_set("maxmemory-policy", "noeviction")
        r.config_set("maxmemory", 1)

    await _refusing_writes(redis_server, refuse, lambda r: r.config_set("maxmemory", 0), "maxmemory")


async def test_redis_turned_read_only_replica_keeps_reads(redis_server):
    """`REPLICAOF` (writes answer READONLY): each write-back was taken for a key of another type, its index DEL failed in
    turn and marked the whole cache down, reads included, and the log said only "failed". Now the error names
    routing.redis_url and the replica, and lookups go on while writes pause."""
    from tests.service_fixtures import free_port

    await _refusing_writes(redis_server, lambda r: r.execute_command("REPLICAOF", "127.0.0.1", free_port()),
                           lambda r: r.execute_command("REPLICAOF", "NO", "ONE"), "routing.redis_url points at a read-only replica")


async def test_redis_password_set_mid_run_is_named(redis_server):
    """`CONFIG SET requirepass` while the worker runs: once its connections are renewed each call fails with NOAUTH; the
    error says to put the password in routing.redis_url (it said only that the cache failed)."""
    import redis as sync_redis

    now = [0.0]
    cache = RedisRouteCache(redis_server.url, max_entries=10, ttl_s=60, clock=lambda: now[0])
    r = sync_redis.Redis.from_url(redis_server.url)
    k = CacheKey("l1", "acme", "u1")
    try:
        assert await cache.set_many({k: "a@1"})
        r.config_set("requirepass", "s3cret")
        r.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")  # connections already open stay logged in
        assert await cache.get_many([k]) is None and cache.errors == 1  # the killed connection
        now[0] = 2.0
        assert await cache.get_many([k]) is None and cache.errors == 2  # a new one, without the password
        assert "routing.redis_url" in cache.last_error and "password" in cache.last_error, cache.last_error
    finally:
        r.execute_command("CONFIG", "SET", "requirepass", "")
        r.close()
        await cache.close()


async def test_a_write_back_costs_three_round_trips_at_most(redis_server, monkeypatch):
    """Redis slow but under routing.redis_timeout_ms: a write-back's latency is its round trips times Redis's. Trimming
    cost two per tenant index over its bound (41 for 20 tenants' sessions, each waited for on the intake path); now the
    writes, the trims and the deletes take three, however many tenants, and the bound still holds."""
    import redis as sync_redis
    from redis.asyncio.connection import AbstractConnection

    # (a timeout of seconds: this counts round trips, and the 50 ms default failed the first write-back after the
    # connection's setup in a process that had run tests/test_config.py first)
    cache = RedisRouteCache(redis_server.url, max_entries=1, ttl_s=60, prefix="rt", timeout_s=5.0)
    r = sync_redis.Redis.from_url(redis_server.url)
    sent = [0]
    send = AbstractConnection.send_packed_command

    async def counted(self, command, check_health=True):
        sent[0] += 1
        return await send(self, command, check_health)

    try:
        tenants = [f"t{i}" for i in range(20)]
        assert await cache.set_many({CacheKey("l2", t, "s0"): "a@1" for t in tenants})
        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)
        assert await cache.set_many({CacheKey("l2", t, "s1"): "a@1" for t in tenants})
        assert sent[0] <= 3, sent[0]
        assert all(r.zcard(f"rt:index:l2:{t}") == 1 for t in tenants) and not r.exists("rt:l2:t0:s0") and r.exists("rt:l2:t0:s1")
    finally:
        r.close()
        await cache.close()


def test_a_database_number_past_the_servers_is_said_as_such_not_start_it() -> None:
    """routing.redis_url naming database 999 on a server of 16: Redis is up and refuses the SELECT, and the log said
    "start it", as for a Redis that is down. It names the database number and the fix; any other refusal of a running
    Redis no longer says "start it" either."""
    import redis as redis_sync
    from redis.exceptions import ResponseError

    from consumer.route_cache import explain

    client = redis_sync.Redis.from_url("redis://127.0.0.1:6379/999", socket_timeout=5)
    try:
        client.ping()
    except ResponseError as e:
        said = explain(e)
    else:
        raise AssertionError("the server took database 999")
    finally:
        client.close()
    assert "database number in routing.redis_url" in said and "start it" not in said, said
    assert "start it" not in explain(ResponseError("ERR unknown command 'ZPOPMIN'"))
    assert "start it" in explain(ConnectionError("Connection refused"))


async def test_poisoned_entries_count_in_the_workers_metric(tmp_path):
    """Invariant: every entry RedisRouteCache passes over or rewrites (bad_entries) counts in the worker's served
    lora_route_cache_poisoned_total. They were counted on the cache object alone, which no metric showed. A worker built
    for routing.cache = "redis" (the real server at 127.0.0.1:6379, database 12) reads a value that is not UTF-8 and one
    too long to be a reference, then writes back over an index of another type: three."""
    import uuid
    from types import SimpleNamespace

    import redis as sync_redis
    from prometheus_client import generate_latest

    from consumer.config import load_settings
    from consumer.registry import RegistrySnapshot
    from consumer.worker import Worker
    from engine.config import EngineConfig

    url, prefix = "redis://127.0.0.1:6379/12", f"poisoned-{uuid.uuid4().hex}"
    s = load_settings(None, {"routing.cache": "redis", "routing.redis_url": url, "routing.redis_prefix": prefix,
                             "worker.spool_path": str(tmp_path / "spool.sqlite")})
    w = Worker(s, SimpleNamespace(config=EngineConfig(max_batch_size=32)),
               SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=None), ledger=None)
    r = sync_redis.Redis.from_url(url)
    served = lambda: w.metrics.registry.get_sample_value("lora_route_cache_poisoned_total")  # noqa: E731
    try:
        assert served() == 0
        r.set(f"{prefix}:l1:acme:u1", b"\xff\xfe")
        r.set(f"{prefix}:l2:acme:s1", "x" * 1000)
        r.set(f"{prefix}:index:l1:acme", "not a sorted set")
        keys = [CacheKey("l1", "acme", "u1"), CacheKey("l2", "acme", "s1")]
        assert await w.router.cache.get_many(keys) == {}
        assert served() == 2
        assert await w.router.cache.set_many({CacheKey("l1", "acme", "u2"): "a@1"}) is True
        assert served() == 3 and "lora_route_cache_poisoned_total 3.0" in generate_latest(w.metrics.registry).decode()
    finally:
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)
        r.close()
        await w.router.cache.close()
        w.spool.close()


async def test_trimming_deletes_only_the_tenants_own_route_keys(redis_server):
    """The bound deletes the keys its index names; an index member that is no route key of that tenant and level (put
    there by another client: a worker's id lease, another tenant's entry, another program's key) was deleted with them.
    Now such a member leaves the index, counted as poisoned, and its key stays."""
    import redis as sync_redis

    cache = RedisRouteCache(redis_server.url, max_entries=2, ttl_s=60, prefix="tr")
    r = sync_redis.Redis.from_url(redis_server.url)
    foreign = ["tr:worker:lorabatch:w1", "tr:l1:globex:u1", "tr:l2:acme:s1", "other-app:config"]
    try:
        for key in foreign:
            r.set(key, "keep")
        r.zadd("tr:index:l1:acme", dict.fromkeys(foreign, int(time.time() * 1000) - 1000))  # unexpired, trimmed first
        for i in range(6):
            assert await cache.set_many({CacheKey("l1", "acme", f"u{i}"): f"a@{i}"})
        assert [r.get(key) for key in foreign] == [b"keep"] * len(foreign)
        assert cache.bad_entries == len(foreign) and cache.errors == 0
        assert sorted(r.zrange("tr:index:l1:acme", 0, -1)) == [b"tr:l1:acme:u4", b"tr:l1:acme:u5"]
        assert r.get("tr:l1:acme:u0") is None and r.get("tr:l1:acme:u5") == b"a@5"  # the tenant's own still trimmed
    finally:
        r.close()
        await cache.close()


async def _answering(reply: bytes):
    """A server that refuses the handshake (as a Redis before 6 does, so the client speaks RESP2) and answers every other
    command with `reply`: a proxy or another program at routing.redis_url. Returns (server, url)."""
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(b"-ERR unknown command\r\n" if b"HELLO" in data or b"CLIENT" in data else reply)
                await writer.drain()
        except ConnectionError:
            pass

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"


@pytest.mark.parametrize("reply", [b"+OK\r\n", b":5\r\n", b"*2\r\n:5\r\n:6\r\n", b"*2\r\n*1\r\n$1\r\nx\r\n$1\r\nx\r\n", b"$-5\r\n"])
async def test_replies_no_redis_gives_are_the_cache_away_not_the_batch_failed(reply):
    """MGET answered with a status, an integer, an array of integers or of arrays, or a negative length (no Redis answers
    so; a proxy or another server at routing.redis_url may) raised TypeError, AttributeError or ValueError out of the
    lookup, and the worker failed every job of the batch `routing_failed`, batch after batch, with no backoff. Now it is
    a cache error as Redis away is: the lookup answers None, the write-back False, and routing goes on by the rules and
    defaults, saying so."""
    from consumer.routing import Route, Router
    from consumer.rules import RuleClassifier
    from tests.test_routing import job, snapshot

    server, url = await _answering(reply)
    now = [0.0]
    cache = RedisRouteCache(url, max_entries=10, ttl_s=60, timeout_s=0.5, clock=lambda: now[0])
    try:
        keys = [CacheKey("l1", "acme", "u1"), CacheKey("l2", "acme", "s1")]
        assert await cache.get_many(keys) is None and cache.errors == 1 and not cache.available
        assert "routing.redis_url" in cache.last_error, cache.last_error
        now[0] = 10.0
        assert await cache.set_many({keys[0]: "support@2"}) is False and cache.errors == 2
        now[0] = 20.0
        snap = snapshot()
        routes = await Router(cache).route_batch(snap, RuleClassifier(snap.rules), [job(user_id="u1", session_id="s1")])
        assert [(r.reason, r.detail) for r in routes if isinstance(r, Route)] == [("tenant_default", "cache unavailable")], routes
    finally:
        await cache.close()
        server.close()
