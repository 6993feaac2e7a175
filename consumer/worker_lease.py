"""One live worker per worker id: a worker refuses an id that another running worker holds.

A worker id (`--worker-id`) is the Kafka group.instance.id and names the worker's spool file. Two workers started
under one id both ran every job over the embedded broker (92 results for 60 jobs, GPU work doubled, no line in either
log); on Kafka the second join fences the first and the two knock each other out. A restart under the same id after
a crash must still work at once: that is what static membership is for.

The `lorabatch worker` command takes the id before it builds its engine: a model on a GPU takes minutes to load, and a
worker refused its id loaded it for nothing. The lease is refreshed from then on, through the engine's build, and the
worker checks it again once Redis answers (`Worker.run`), before it joins its group.

Two holds, both taken before the worker joins its group, both given back as it exits:
- on this host, an exclusive `flock` on `<spool folder>/<worker id>.worker.lock`, holding the holder's host and pid:
  the kernel frees a killed worker's lock, so a restart after kill -9 takes it at once; it needs no Redis, which the
  embedded defaults (routing.cache = "lru") have none of;
- beside the adapter store, an exclusive `flock` on `<store.adapter_dir>/.workers/<group>.<worker id>.lock` (the group
  hashed): two workers on one host with the same id but different spool folders (two config files) share the store, so
  the second is refused there; a store the worker cannot write to (mounted read-only) goes without it, said once;
- across hosts, where routing.cache = "redis", a lease in Redis, `<routing.redis_prefix>:worker:<group>:<worker id>`,
  set with NX and a TTL of LEASE_TTL_S to a value naming a random token, the host and the pid, and refreshed every
  REFRESH_S while the worker runs. A crashed worker's lease lapses within LEASE_TTL_S.
At start a hold taken by another is waited for up to LEASE_TTL_S (a predecessor killed or still draining lets go
within it); one still held then ends the start with WorkerIdTaken, naming the id, the holder and the fix. A refresh
that finds the lease taken by another (this worker was frozen past the TTL and another took the id) says so loudly
and counts `lorabatch_worker_id_conflicts_total`. Redis that cannot be reached costs the check across hosts, never
the worker: said once, and the lease is taken when Redis answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from consumer.logs import Throttle

if TYPE_CHECKING:
    from consumer.config import Settings

log = logging.getLogger("lorabatch.worker")

# 10 s: Kafka's default session timeout, the time after which the group itself counts a silent member as gone; a
# restart after a crash waits at most this long. Refreshed every 2 s, so four refreshes in a row may fail (a slow Redis,
# a loop held by a long call) before a live worker's lease lapses.
LEASE_TTL_S = 10.0
REFRESH_S = 2.0
REDIS_TIMEOUT_S = 1.0  # a lease call slower than this counts as Redis away (it runs off the jobs' path)
RETRY_S = 0.5  # how often a hold that another has is tried again at start

# Take the lease when it is free or ours, and return what it holds now (ours, or the other holder's value).
_TAKE = """
local v = redis.call('GET', KEYS[1])
if v == false or v == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return ARGV[1]
end
return v
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class WorkerIdTaken(Exception):
    """Another live worker holds this worker id; waiting does not end it."""

    retriable = False


class LockUnusable(Exception):
    """The lock file of the id cannot be made beside the spool (its folder is a file, or not writable)."""

    retriable = False


def describe(value: bytes | str | None) -> str:
    """The holder named by a lease or lock file's value: "host H, pid P", or the raw text when it is no such value."""
    if value is None:
        return "an unknown holder"
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    try:
        d = json.loads(text)
        return f"host {d['host']}, pid {d['pid']}"
    except (ValueError, KeyError, TypeError):
        return f"an unknown holder ({text[:100]!r})"


def lease_for(settings: Settings, conflicts=None) -> WorkerIdLease | None:
    """The lease of the worker id that `settings` set by hand, beside its spool file (None for a default id,
    hostname-pid, which is no other process's)."""
    w, r = settings.worker, settings.routing
    if not w.worker_id:
        return None
    return WorkerIdLease(w.worker_id, settings.kafka.group_id, w.spool_file().parent,
                         redis_url=r.redis_url if r.cache == "redis" else None, prefix=r.redis_prefix,
                         ttl_s=LEASE_TTL_S, refresh_s=REFRESH_S, conflicts=conflicts,
                         store_dir=Path(settings.store.adapter_dir))


def _flock(path: Path, value: str) -> tuple[int | None, str | None]:
    """Open `path` (its folder made) and take its exclusive flock without waiting: (its fd, None) with `value` written
    into it, or (None, the holder its value names) when another holds it. Opening's OSError is the caller's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            return None, describe(os.pread(fd, 4096, 0))
        finally:
            os.close(fd)
    os.ftruncate(fd, 0)
    os.pwrite(fd, value.encode(), 0)
    return fd, None


class WorkerIdLease:
    def __init__(self, worker_id: str, group_id: str, lock_dir: Path, *, redis_url: str | None = None,
                 prefix: str = "lorabatch:route", ttl_s: float = LEASE_TTL_S, refresh_s: float = REFRESH_S,
                 conflicts=None, store_dir: Path | None = None):
        """`redis_url`: where the lease across hosts lives (None: on this host only). `conflicts`: a Prometheus
        counter, counted at each refresh that finds the lease another's. `store_dir`: the adapter store, beside which
        the id's second lock lies (None: the spool folder's lock only)."""
        assert 0 < refresh_s < ttl_s, (refresh_s, ttl_s)
        self.worker_id, self.group_id = worker_id, group_id
        self.lock_path = Path(lock_dir) / f"{worker_id}.worker.lock"
        group = hashlib.sha256(group_id.encode()).hexdigest()[:16]  # a group id may hold any character
        self.store_lock_path = None if store_dir is None else Path(store_dir) / ".workers" / f"{group}.{worker_id}.lock"
        self._store_fd: int | None = None
        self.key = f"{prefix}:worker:{group_id}:{worker_id}"
        self.ttl_s, self.refresh_s = ttl_s, refresh_s
        self.value = json.dumps({"token": secrets.token_hex(8), "host": socket.gethostname(), "pid": os.getpid()})
        self._conflicts = conflicts
        self._fd: int | None = None
        self._redis = None
        if redis_url is not None:
            import redis.asyncio as aioredis

            self._redis = aioredis.Redis.from_url(redis_url, socket_timeout=REDIS_TIMEOUT_S,
                                                  socket_connect_timeout=REDIS_TIMEOUT_S, retry_on_timeout=False)
        self.held = False  # the Redis lease, as of the last call that reached Redis
        self._unchecked = False  # said that Redis could not be reached, not yet that it answers again
        self._conflict_throttle = Throttle(60.0)
        self._other: str | None = None  # the other holder last said
        self.refreshing: asyncio.Task | None = None  # refresh_forever, from start_refreshing() to release()
        self._released = False

    # ---------------------------------------------------------------- start

    async def acquire(self, stopping: asyncio.Event | None = None) -> None:
        """Hold the id, on this host and in Redis; wait up to the TTL for a holder to let go; WorkerIdTaken if none
        does. Returns at once when `stopping` is set (the caller stops anyway)."""
        deadline = time.monotonic() + self.ttl_s + RETRY_S
        said = None
        while True:
            holder = self._lock_here()
            if holder is None:
                holder = self._lock_at_store()
            if holder is None:
                holder = await self._take()
            if holder is None:
                if said is not None:
                    log.info("worker id %s is free now (%s let go); starting", self.worker_id, said)
                return
            if said != holder:
                said = holder
                log.warning("worker id %s is held by %s (another worker running, or one that died: its hold lapses within "
                            "%.0f s); waiting for it", self.worker_id, holder, self.ttl_s)
            if time.monotonic() >= deadline:
                self.close_lock()
                raise WorkerIdTaken(
                    f"worker id {self.worker_id} is held by a live worker ({holder}) of group {self.group_id}: it has "
                    f"held it for the {self.ttl_s:.0f} s waited; start this worker with another --worker-id "
                    f"(worker.worker_id), or stop that worker first")
            if stopping is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), RETRY_S)
                if stopping.is_set():
                    self.close_lock()
                    return
            else:
                await asyncio.sleep(RETRY_S)

    def _lock_here(self) -> str | None:
        """Take the lock file of the id on this host; None when taken (or held already), else its holder."""
        if self._fd is not None:
            return None
        try:
            self._fd, holder = _flock(self.lock_path, self.value)
        except OSError as e:  # taken before the spool is opened: named by the key that sets the folder, as the spool is
            why = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
            raise LockUnusable(f"the worker id's lock file {self.lock_path} cannot be opened ({why}); set "
                               f"worker.spool_path to a file in a writable folder (the lock lies beside it)") from e
        return holder and holder + " on this host"

    def _lock_at_store(self) -> str | None:
        """Take the id's lock beside the adapter store; None when taken (or held already, or the store has no room for
        it), else its holder."""
        if self._store_fd is not None or self.store_lock_path is None:
            return None
        try:
            self._store_fd, holder = _flock(self.store_lock_path, self.value)
        except OSError as e:  # a store mounted read-only for the workers: the spool folder's lock still holds
            log.warning("worker id %s: its lock beside the adapter store cannot be made (%s: %s); two workers on this host "
                        "under this id with different spool folders would not be told apart", self.worker_id,
                        e.strerror or e, self.store_lock_path)
            self.store_lock_path = None
            return None
        return holder and holder + " (its lock beside the adapter store)"

    async def _take(self) -> str | None:
        """Take or renew the Redis lease; None when it is ours (or cannot be checked), else its holder."""
        if self._redis is None:
            return None
        from consumer.route_cache import UnexpectedReply, explain

        try:
            now = await self._redis.eval(_TAKE, 1, self.key, self.value, int(self.ttl_s * 1000))
            if not isinstance(now, bytes):  # the script returns a string: an integer, array or nil is no Redis's answer
                raise UnexpectedReply(f"the lease's EVAL answered {str(now)[:80]}, not a string")
        except Exception as e:  # noqa: BLE001 - RedisError, OSError, or a reply redis-py could not read (ValueError): Redis unusable, as if away
            self.held = False
            if not self._unchecked:
                self._unchecked = True
                log.warning("worker id %s could not be checked in Redis (%s): running without the check that no other "
                            "host runs a worker under this id; it is taken when Redis answers", self.worker_id, explain(e))
            return None
        if self._unchecked:
            self._unchecked = False
            log.warning("Redis answers again: worker id %s is checked there", self.worker_id)
        self.held = now == self.value.encode()
        return None if self.held else describe(now)

    # ---------------------------------------------------------------- while running

    async def refresh(self) -> bool:
        """Renew the lease; False when another holds it (said in the log, counted)."""
        holder = await self._take()
        if holder is None:
            self._other = None
            return True
        if self._conflicts is not None:
            self._conflicts.inc()
        changed = holder != self._other
        if self._conflict_throttle.due() or changed:  # a line when the holder changes, else one a minute
            self._other = holder
            log.error("worker id %s is now held by %s, not by this worker (host %s, pid %d): two workers run under one id "
                      "and may both run the same jobs (lorabatch_worker_id_conflicts_total); stop one, or give it another "
                      "--worker-id", self.worker_id, holder, socket.gethostname(), os.getpid())
        return False

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            await self.refresh()

    def start_refreshing(self) -> None:
        """Refresh the lease on a task of its own until release() (the engine's build and the broker's wait both outlast
        the TTL); once only."""
        if self.refreshing is None:
            self.refreshing = asyncio.create_task(self.refresh_forever(), name="worker-id-lease")

    # ---------------------------------------------------------------- stop

    async def release(self) -> None:
        """Stop refreshing, give the id back (the Redis lease only where it is still ours) and close the Redis client.
        Once: a second call does nothing (the command releases what a worker that never ran leaves held)."""
        if self._released:
            return
        self._released = True
        if self.refreshing is not None and not self.refreshing.done():
            self.refreshing.cancel()
            await asyncio.wait([self.refreshing], timeout=2 * REDIS_TIMEOUT_S)  # a Redis call ends within its timeout
        self.close_lock()
        if self._redis is None:
            return
        try:
            if self.held:
                await self._redis.eval(_RELEASE, 1, self.key, self.value)
        except Exception as e:  # noqa: BLE001 - RedisError, OSError, or a reply redis-py could not read: it lapses within the TTL anyway
            log.warning("worker id %s: its Redis lease could not be given back (%s); it lapses within %.0f s",
                        self.worker_id, e, self.ttl_s)
        finally:
            self.held = False
            await self._redis.aclose()

    def close_lock(self) -> None:
        for name in ("_fd", "_store_fd"):
            if (fd := getattr(self, name)) is not None:
                os.close(fd)
                setattr(self, name, None)
