"""The routing caches: L1 (tenant, user) -> adapter and L2 (tenant, session) -> adapter.

Two implementations of one interface: an in-process LRU (the embedded default) and Redis (shared by
all workers, so a session sticks to its adapter whichever worker serves it). Both are bounded and
expire entries after a TTL. Lookups for a whole fetched batch go in one round trip.

Redis being away must never stop routing: every Redis error marks the cache unavailable for a short
backoff (so a dead server costs one timeout, not one per job), lookups answer "unavailable" and the
router goes on to its rules and defaults; the next lookup after the backoff tries again. So does a reply no Redis sends (a
status or an integer for MGET, a negative length: another server or a proxy at routing.redis_url), which raised out of the
lookup and failed every job of the batch.

What Redis holds is not trusted either (another client may write there): a value that is not UTF-8, or
too long to be an adapter reference, is a miss; a key of ours holding another type (an index that is
not a sorted set) is deleted and rewritten, not taken for Redis being down, which would turn the cache
off for every tenant at each write; an index member that is no route key of its tenant and level (the bound deletes the
keys its index names) leaves the index, its key untouched. Each such entry counts in `lora_route_cache_poisoned_total`.

Redis refusing writes while it answers reads (at its maxmemory under `noeviction`: OOM; a read-only replica: READONLY;
a user whose ACL forbids writing: NOPERM) is neither: it counts as a cache error (said in the worker's log with the
setting to fix), write-backs stop for the backoff, lookups go on; the tenant's index is left alone (it was deleted as
if of another type, so the bound lost track of the keys already written).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis
from redis.exceptions import AuthenticationError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

MAX_VALUE_CHARS = 256  # longer values are not adapter references (a name and a version are at most 170)

# What an operator changes when Redis refuses a call, by the error's code (its first word)
FIXES = {
    "OOM": "Redis is at its maxmemory under maxmemory-policy noeviction: raise maxmemory, or set an evicting policy "
           "(allkeys-lru)",
    "READONLY": "routing.redis_url points at a read-only replica: point it at the primary",
    "NOAUTH": "Redis requires a password: put it in routing.redis_url (redis://:PASSWORD@host:port/db)",
    "WRONGPASS": "Redis refuses the user or password in routing.redis_url: fix them there",
    "NOPERM": "the ACL of routing.redis_url's user forbids a command or key the route cache needs (GET SET MGET ZADD "
              "PEXPIRE ZREMRANGEBYSCORE ZCARD ZPOPMIN DEL on the routing.redis_prefix keys): grant them",
    "MISCONF": "Redis refuses writes since its last RDB save failed: fix its disk, or its stop-writes-on-bgsave-error",
    "BUSY": "Redis is running a long script: end it (SCRIPT KILL) or let it finish",
    "MASTERDOWN": "the replica of routing.redis_url lost its primary: point routing.redis_url at the primary",
}


def explain(e: BaseException) -> str:
    """One line for the log: the error and what to change, naming the setting where one is at fault."""
    text = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    code = getattr(e, "status_code", None) or next((w for w in text.split(" ", 1)[:1] if w.isupper()), None)
    if isinstance(e, AuthenticationError) and code not in FIXES:
        code = "NOAUTH"
    brief = f"{type(e).__name__}: {code + ' ' if code and not text.startswith(code) else ''}{text}".rstrip(": ")
    if code in FIXES:
        return f"{brief}; {FIXES[code]}"
    if isinstance(e, RedisTimeout):
        return f"{brief}; Redis answered slower than routing.redis_timeout_ms: it is overloaded or blocked (its SLOWLOG)"
    if "DB index is out of range" in text:
        return (f"{brief}; the database number in routing.redis_url is past the server's `databases` setting: use a lower "
                f"one (redis://host:port/0) or raise `databases`")
    if isinstance(e, ResponseError):  # Redis is up and answered: starting it is no fix
        return f"{brief}; Redis refused the call: fix routing.redis_url or the server's configuration"
    if not isinstance(e, (RedisError, OSError)):  # a reply the client could not read, or one of a type no Redis sends
        return (f"{brief}; the server at routing.redis_url answered what Redis does not: point routing.redis_url at a Redis "
                f"server (not another program, nor a proxy that changes its replies)")
    return f"{brief}; start it, or fix routing.redis_url"


class UnexpectedReply(Exception):
    """A reply of a type no Redis sends for the command (another server, or a proxy, at routing.redis_url)."""


@dataclass(frozen=True)
class CacheKey:
    level: str  # "l1" (user) or "l2" (session)
    tenant_id: str
    subject: str  # the user id or session id

    def redis_key(self, prefix: str) -> str:
        return f"{prefix}:{self.level}:{self.tenant_id}:{self.subject}"


class RouteCache(Protocol):
    name: str

    async def get_many(self, keys: list[CacheKey]) -> dict[CacheKey, str] | None:
        """Values found (missing keys absent); None when the cache is unavailable."""

    async def set_many(self, items: dict[CacheKey, str]) -> bool:
        """Write back decisions; False when the cache is unavailable."""


class LruRouteCache:
    """In-process, bounded by entries, with a TTL: the embedded default."""

    name = "lru"

    def __init__(self, max_entries: int, ttl_s: float, clock=time.monotonic):
        assert max_entries >= 1 and ttl_s > 0
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self._clock = clock
        self._data: OrderedDict[CacheKey, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    async def get_many(self, keys: list[CacheKey]) -> dict[CacheKey, str]:
        now = self._clock()
        found = {}
        for k in keys:
            entry = self._data.get(k)
            if entry is None:
                continue
            if entry[1] <= now:
                del self._data[k]
                continue
            self._data.move_to_end(k)
            found[k] = entry[0]
        return found

    async def set_many(self, items: dict[CacheKey, str]) -> bool:
        expires = self._clock() + self.ttl_s
        for k, v in items.items():
            self._data[k] = (v, expires)
            self._data.move_to_end(k)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)
        return True


class RedisRouteCache:
    """Redis, shared by the workers. Entries expire after the TTL; each tenant's keys of one level are
    indexed in a sorted set by last write and trimmed to `max_entries`, so one tenant's churn cannot
    grow the cache without bound."""

    name = "redis"

    def __init__(self, url: str, max_entries: int, ttl_s: float, *, prefix: str = "lorabatch:route",
                 timeout_s: float = 0.05, backoff_s: float = 1.0, clock=time.monotonic, poisoned=None):
        """`poisoned`: a Prometheus counter (lora_route_cache_poisoned_total) of the entries `bad_entries` counts."""
        # Bytes, decoded here: a value that is not UTF-8 is a miss, where the client's decoding raised for the batch
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              decode_responses=False, retry_on_timeout=False)
        self.max_entries = max_entries
        self.ttl_ms = int(ttl_s * 1000)
        self.prefix = prefix
        self.backoff_s = backoff_s
        self._clock = clock
        self._down_until = 0.0
        self.errors = 0
        self.last_error = ""  # `explain` of the latest error, for the worker's log
        self._writes_down_until = 0.0  # Redis refusing writes (OOM, READONLY, NOPERM) while it answers reads
        # `explain` of the latest failure of Redis itself (cleared by any call that succeeds) and of its latest refusal of
        # writes (cleared by a write that succeeds), for /readyz
        self._read_error: str | None = None
        self._write_error: str | None = None
        self.bad_entries = 0  # values that were no adapter reference, and keys of ours of the wrong type, since start
        self._poisoned = poisoned

    @property
    def available(self) -> bool:
        return self._clock() >= self._down_until

    @property
    def problem(self) -> str | None:
        """What fails in Redis as of the latest calls (it answered none, or refused a write, with no call since that
        succeeded), or None: /readyz names it (consumer.health). With no traffic it stays as the latest call left it."""
        return self._read_error or self._write_error

    def _failed(self, e: BaseException, *, writes_only: bool = False) -> None:
        self.errors += 1
        self.last_error = explain(e)
        if writes_only:
            self._write_error = self.last_error
        else:
            self._read_error = self.last_error
        if writes_only:
            self._writes_down_until = self._clock() + self.backoff_s
        else:
            self._down_until = self._clock() + self.backoff_s

    async def get_many(self, keys: list[CacheKey]) -> dict[CacheKey, str] | None:
        if not keys:
            return {}
        if not self.available:
            return None
        try:
            values = await self.client.mget([k.redis_key(self.prefix) for k in keys])
            if not isinstance(values, list) or any(v is not None and not isinstance(v, bytes) for v in values):
                raise UnexpectedReply(f"MGET answered {str(values)[:80]}, not a list of strings and nils")
        except Exception as e:  # noqa: BLE001 - RedisError, OSError, or a reply redis-py could not read: the cache's fault, never the batch's
            self._failed(e)
            return None
        self._read_error = None
        found = {}
        for k, v in zip(keys, values):
            if v is None:
                continue
            try:
                text = v.decode("utf-8") if len(v) <= MAX_VALUE_CHARS else None
            except UnicodeDecodeError:
                text = None
            if text is None:
                self._bad(1)
                continue
            found[k] = text
        return found

    def _bad(self, n: int) -> None:
        self.bad_entries += n
        if self._poisoned is not None:
            self._poisoned.inc(n)

    async def set_many(self, items: dict[CacheKey, str]) -> bool:
        if not items:
            return True
        if not self.available or self._clock() < self._writes_down_until:
            return False
        now_ms = int(time.time() * 1000)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                indexes: dict[str, bytes] = {}  # index -> how its members (route keys) begin, in insertion order
                for k, v in items.items():
                    rk = k.redis_key(self.prefix)
                    index = f"{self.prefix}:index:{k.level}:{k.tenant_id}"
                    pipe.set(rk, v, px=self.ttl_ms)  # 3 replies per item ...
                    pipe.zadd(index, {rk: now_ms})
                    pipe.pexpire(index, self.ttl_ms)
                    indexes[index] = f"{self.prefix}:{k.level}:{k.tenant_id}:".encode()
                for index in indexes:  # ... then 2 per index: drop expired members, count the rest
                    pipe.zremrangebyscore(index, "-inf", now_ms - self.ttl_ms)
                    pipe.zcard(index)
                replies = await pipe.execute(raise_on_error=False)
            failed = [r for r in replies if isinstance(r, Exception)]
            if any(not isinstance(r, ResponseError) for r in failed):
                raise failed[0]  # the connection, not the data: Redis is away
            refused = [r for r in failed if not _wrong_type(r)]
            if refused:  # Redis refuses writes (OOM, READONLY, NOPERM): not our data's fault, the index stays
                self._failed(refused[0], writes_only=True)
                return False
            index_replies = [replies[3 * i + 1 : 3 * i + 3] for i in range(len(items))]
            wrong = {index for (k, _), answer in zip(items.items(), index_replies) if any(isinstance(r, ResponseError) for r in answer)
                     for index in [f"{self.prefix}:index:{k.level}:{k.tenant_id}"]}  # fmt: skip
            cards = replies[3 * len(items) + 1 :: 2]
            over: dict[str, int] = {}  # index -> how many of its least recently written keys go
            for index, card in zip(indexes, cards):
                if index in wrong or isinstance(card, Exception):
                    wrong.add(index)
                elif card > self.max_entries:
                    over[index] = card - self.max_entries
            # Two more round trips at most, however many indexes are over their bound (it was two per index: a write-back
            # touching 20 tenants' indexes at the bound cost 41 round trips, each up to routing.redis_timeout_ms)
            doomed: list[bytes | str] = []
            if over:
                async with self.client.pipeline(transaction=False) as pipe:
                    for index, n in over.items():
                        pipe.zpopmin(index, n)
                    popped = [(index, member) for index, evicted in zip(over, await pipe.execute()) for member, _score in evicted]
                # Only the tenant's own route keys of that level are deleted: a member naming any other key (put there
                # by another client: a worker's id lease, another tenant's entry, another program's key) leaves the
                # index, its key stays
                doomed = [member for index, member in popped if member.startswith(indexes[index])]
                if len(doomed) < len(popped):
                    self._bad(len(popped) - len(doomed))
            if wrong:  # not our sorted set (another client wrote there): gone, so the next write makes it afresh
                self._bad(len(wrong))
                doomed += sorted(wrong)
            if doomed:
                await self.client.delete(*doomed)
        except Exception as e:  # noqa: BLE001 - RedisError, OSError, or a reply of a type no Redis sends (TypeError reading it)
            self._failed(e)
            return False
        self._read_error = self._write_error = None  # a write that went through: Redis answers and takes writes
        return True

    async def close(self) -> None:
        await self.client.aclose()


def _wrong_type(e: Exception) -> bool:
    """A reply saying one of our keys holds another type (another client wrote there): the data's fault, not Redis's."""
    return getattr(e, "status_code", None) == "WRONGTYPE" or str(e).startswith("WRONGTYPE")
