"""One live worker per worker id (consumer.worker_lease): a second worker under a held id refuses to start, naming the
holder and the fix; a restart after kill -9 of the holder proceeds within the lease's TTL; Redis away costs the check
across hosts, never the start. Real Redis (db 14 of the machine's, a private server for the outage) and real processes.

Two workers on two hosts are two leases with lock folders of their own; two on one host share the folder."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import uuid

import pytest
import redis

from consumer.metrics import WorkerMetrics
from consumer.worker_lease import WorkerIdLease, WorkerIdTaken
from tests.service_fixtures import redis_server  # noqa: F401 - a fixture

REDIS_URL = "redis://127.0.0.1:6379/14"
TTL_S, REFRESH_S = 1.5, 0.3  # short, so that the waits for a lapse stay short


@pytest.fixture
def shared_redis():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"test-lease-{uuid.uuid4().hex[:8]}"
    yield prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


def _lease(folder, prefix: str | None, worker_id: str = "gpu-0", **kw) -> WorkerIdLease:
    return WorkerIdLease(worker_id, "workers", folder, redis_url=REDIS_URL if prefix else None, prefix=prefix or "x",
                         ttl_s=kw.pop("ttl_s", TTL_S), refresh_s=kw.pop("refresh_s", REFRESH_S), **kw)


def _holder_process(folder, prefix: str | None, ttl_s: float) -> subprocess.Popen:
    """A process that holds `gpu-0` and refreshes it, as a running worker does; it prints `held` once it holds it."""
    code = textwrap.dedent(f"""
        import asyncio
        from consumer.worker_lease import WorkerIdLease
        async def main():
            lease = WorkerIdLease("gpu-0", "workers", {str(folder)!r}, redis_url={REDIS_URL if prefix else None!r},
                                  prefix={prefix or "x"!r}, ttl_s={ttl_s}, refresh_s={REFRESH_S})
            await lease.acquire()
            print("held", flush=True)
            await lease.refresh_forever()
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.stdout.readline().strip() == "held", proc.poll()
    return proc


async def test_a_second_worker_on_another_host_refuses_the_id_of_a_live_one(tmp_path, shared_redis, caplog):
    """Held in Redis and refreshed: the second start waits a TTL, then refuses with the id, the holder's host and pid,
    and the fix; the holder goes on holding it."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    first = _lease(tmp_path / "host-a", shared_redis)
    await first.acquire()
    refreshing = asyncio.create_task(first.refresh_forever())
    second = _lease(tmp_path / "host-b", shared_redis)
    try:
        with pytest.raises(WorkerIdTaken) as taken:
            await second.acquire()
        assert await first.refresh()
    finally:
        refreshing.cancel()
        await first.release()
        await second.release()
    said = str(taken.value)
    assert "worker id gpu-0 is held by a live worker" in said and f"pid {os.getpid()}" in said, said
    assert "another --worker-id" in said and "stop that worker" in said, said
    assert any("worker id gpu-0 is held by host" in r.getMessage() and "waiting for it" in r.getMessage()
               for r in caplog.records)


async def test_a_second_worker_on_the_same_host_refuses_without_redis(tmp_path):
    """routing.cache = "lru" (the embedded default) has no Redis: the lock beside the spool still refuses a second
    process under the id, naming the holder's pid."""
    holder = _holder_process(tmp_path, None, TTL_S)
    try:
        with pytest.raises(WorkerIdTaken, match=rf"held by a live worker \(host .*, pid {holder.pid} on this host\)"):
            await _lease(tmp_path, None).acquire()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("same_host", [True, False])
async def test_a_restart_after_kill_9_takes_the_id(tmp_path, shared_redis, caplog, same_host):
    """The holder is killed with SIGKILL (no release): a restart under its id proceeds, after waiting for its lease to
    lapse (within the TTL); on the same host its lock is freed by the kernel at once."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    holder = _holder_process(tmp_path / "host-a", shared_redis, ttl_s=TTL_S)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    restart = _lease(tmp_path / ("host-a" if same_host else "host-b"), shared_redis)
    try:
        await restart.acquire()
        assert restart.held and await restart.refresh()
    finally:
        await restart.release()
    said = [r.getMessage() for r in caplog.records]
    assert any(f"pid {holder.pid}" in m and "waiting for it" in m for m in said), said
    assert any("worker id gpu-0 is free now" in m for m in said), said


async def test_a_clean_stop_frees_the_id_at_once(tmp_path, shared_redis, caplog):
    """release() gives the lease and the lock back: the next start under the id waits for nothing."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    first = _lease(tmp_path, shared_redis)
    await first.acquire()
    await first.release()
    second = _lease(tmp_path, shared_redis)
    await second.acquire()
    await second.release()
    assert not any("waiting for it" in r.getMessage() for r in caplog.records)


async def test_redis_away_the_worker_starts_and_says_so_once(tmp_path, caplog):
    """Redis unreachable (a private server, stopped): the id is taken on this host, the worker starts, and one line
    says the id could not be checked in Redis, however many refreshes fail."""
    from consumer.broker import free_port

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    said = await _unchecked_starts(tmp_path, caplog, f"redis://127.0.0.1:{free_port()}/0")
    assert len(said) == 1 and "worker id gpu-0" in said[0], said


async def _unchecked_starts(folder, caplog, url: str) -> list[str]:
    """Take gpu-0 with Redis at `url` unusable and refresh it 3 times (each must hold): the lines saying so."""
    lease = WorkerIdLease("gpu-0", "workers", folder, redis_url=url, ttl_s=TTL_S, refresh_s=REFRESH_S)
    try:
        await lease.acquire()
        assert not lease.held
        for _ in range(3):
            assert await lease.refresh()
    finally:
        await lease.release()
    return [r.getMessage() for r in caplog.records if "could not be checked in Redis" in r.getMessage()]


@pytest.mark.parametrize("reply", [b":5\r\n", b"*2\r\n:5\r\n:6\r\n", b"$-5\r\n", b"$-1\r\n", b"*0\r\n"])
async def test_a_reply_no_redis_gives_is_redis_away_not_a_crash_nor_a_holder(tmp_path, caplog, reply):
    """The lease's EVAL answered with an integer, an array, a negative length or a nil (no Redis answers so: the script
    returns a string; a proxy or another program at routing.redis_url may) raised TypeError or ValueError out of the
    lease, ending the worker's start with a traceback or its refresh task, and so the worker; an array or a nil was
    taken for another holder, and the start refused the id. Now it is Redis that cannot be used, as Redis away is: the
    worker starts, its refreshes go on, and one line names routing.redis_url."""
    from tests.test_route_cache import _answering

    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    server, url = await _answering(reply)
    try:
        said = await _unchecked_starts(tmp_path, caplog, url)
    finally:
        server.close()
    assert len(said) == 1 and "routing.redis_url" in said[0], said


async def test_redis_back_the_lease_is_taken(tmp_path, redis_server, caplog):
    """Redis that was away at start is checked at a later refresh, and the lease is taken there."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    redis_server.stop()
    lease = WorkerIdLease("gpu-0", "workers", tmp_path, redis_url=redis_server.url, ttl_s=TTL_S, refresh_s=REFRESH_S)
    try:
        await lease.acquire()
        assert not lease.held
        redis_server.start()
        assert await lease.refresh() and lease.held
    finally:
        await lease.release()
    assert any("Redis answers again" in r.getMessage() for r in caplog.records)


async def test_a_refresh_that_finds_the_id_taken_says_so_and_counts(tmp_path, shared_redis, caplog):
    """This worker was frozen past the TTL and another took the id: its next refresh logs an error naming the other
    holder and counts lorabatch_worker_id_conflicts_total; it does not take the lease back."""
    caplog.set_level(logging.INFO, logger="lorabatch.worker")
    metrics = WorkerMetrics()
    lease = _lease(tmp_path / "host-a", shared_redis, conflicts=metrics.worker_id_conflicts)
    await lease.acquire()
    other = _lease(tmp_path / "host-b", shared_redis)
    client = redis.Redis.from_url(REDIS_URL)
    client.set(lease.key, other.value, px=10_000)  # as the other's acquire does once this lease has lapsed
    try:
        assert not await lease.refresh()
        assert not await lease.refresh()
        assert client.get(lease.key) == other.value.encode()
    finally:
        await lease.release()
        await other.release()
        client.close()
    assert metrics.registry.get_sample_value("lorabatch_worker_id_conflicts_total") == 2
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "worker id gpu-0 is now held by host" in errors[0], errors


class _KafkaClient:
    """A Kafka client whose start waits until `answers` is set: a broker that does not answer yet, or a long group join."""

    def __init__(self, answers: asyncio.Event):
        self.answers = answers

    async def start(self) -> None:
        await self.answers.wait()

    async def stop(self) -> None:
        pass


async def test_the_lease_is_refreshed_while_the_worker_waits_to_join_its_group(tmp_path, shared_redis, monkeypatch):
    """The id is taken before the worker joins its group, and the broker may be waited for as long as it takes: the
    lease must not lapse meanwhile, or a second worker under the id takes it and both join. The stop gives it back."""
    from types import SimpleNamespace

    import consumer.worker as worker_module
    from consumer.config import load_settings
    from consumer.registry import RegistrySnapshot
    from engine.config import EngineConfig

    answered = asyncio.Event()
    answered.set()
    monkeypatch.setattr(worker_module, "make_producer", lambda *a, **kw: _KafkaClient(answered))
    settings = load_settings(None, {"worker.spool_path": str(tmp_path / "host-a" / "spool.sqlite"), "worker.worker_id": "gpu-0",
                                    "routing.cache": "redis", "routing.redis_url": REDIS_URL, "routing.redis_prefix": shared_redis,
                                    "kafka.group_id": "workers"})
    registry = SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=SimpleNamespace(root=tmp_path))
    worker = worker_module.Worker(settings, SimpleNamespace(config=EngineConfig(max_batch_size=32)), registry, ledger=None)
    worker.lease.ttl_s, worker.lease.refresh_s = TTL_S, REFRESH_S
    worker._make_consumer = lambda: _KafkaClient(asyncio.Event())  # the group is never joined
    client = redis.Redis.from_url(REDIS_URL)
    task = asyncio.create_task(worker.run())
    try:
        for _ in range(200):
            if client.get(worker.lease.key) is not None:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(3 * TTL_S)  # three TTLs waiting for the broker
        assert client.get(worker.lease.key) == worker.lease.value.encode()
        with pytest.raises(WorkerIdTaken):
            await _lease(tmp_path / "host-b", shared_redis).acquire()
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
    assert client.get(worker.lease.key) is None
    client.close()


def test_the_lock_file_is_none_of_the_spool_sweeper_s():
    """The lock beside the spool files matches neither glob that the spool sweeper deletes by."""
    from pathlib import PurePath

    name = PurePath(WorkerIdLease("gpu-0", "g", "/spool").lock_path).name
    assert not PurePath(name).match("*.sqlite") and not PurePath(name).match("*.sqlite.lock")


# ---------------------------------------------------------------- two `lorabatch worker` processes


def _worker(config, log_path) -> subprocess.Popen:
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config), "--worker-id", "dup"],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


async def _until_said(proc: subprocess.Popen, log_path, text: str, timeout_s: float = 180.0) -> None:
    for _ in range(int(timeout_s * 10)):
        if text in log_path.read_text(errors="replace"):
            return
        assert proc.poll() is None, log_path.read_text()[-3000:]
        await asyncio.sleep(0.1)
    raise AssertionError(f"{text!r} never said:\n{log_path.read_text()[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["lru", "redis"])
async def test_two_worker_processes_under_one_id(broker, tmp_path, demo_set, shared_redis, cache):
    """The audit's case: a second `lorabatch worker --worker-id dup` beside a running one exits with status 2 and an
    error naming the id, the holder's pid and the fix, before joining the group (both were assigned every partition and
    ran every job); after kill -9 of the first, a restart under the id is assigned its partitions. With routing.cache =
    "redis" the two have spool folders of their own, as on two hosts, so Redis alone tells them apart; with "lru" (the
    embedded default) they share one, as on one host."""
    from billing.db import upgrade
    from migrations import SCRIPT_LOCATION
    from tests.service_fixtures import service_settings

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url, script_location=SCRIPT_LOCATION)
    s = await service_settings(broker, tmp_path, url, demo_set["model"], **{
        "routing.cache": cache, "routing.redis_url": REDIS_URL, "routing.redis_prefix": shared_redis,
        "worker.spool_path": str(tmp_path / "host-a" / "spool.sqlite")})
    configs = {}
    for host in ("host-a", "host-b"):
        spool = tmp_path / (host if cache == "redis" else "host-a") / "spool.sqlite"
        configs[host] = tmp_path / f"{host}.toml"
        configs[host].write_text(s.model_copy(update={"worker": s.worker.model_copy(update={"spool_path": str(spool)})}).to_toml())
    logs = {name: tmp_path / f"{name}.log" for name in ("first", "second", "restart")}
    first = _worker(configs["host-a"], logs["first"])
    procs = [first]
    try:
        await _until_said(first, logs["first"], "assigned [")
        second = _worker(configs["host-b"], logs["second"])
        procs.append(second)
        assert await asyncio.to_thread(second.wait, 180) == 2, logs["second"].read_text()[-3000:]
        said = logs["second"].read_text()
        assert f"worker id dup is held by a live worker (host " in said and f"pid {first.pid}" in said, said[-3000:]
        assert "another --worker-id" in said and "assigned [" not in said, said[-3000:]
        first.send_signal(signal.SIGKILL)
        first.wait()
        restart = _worker(configs["host-b"], logs["restart"])
        procs.append(restart)
        await _until_said(restart, logs["restart"], "assigned [")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


async def test_two_spool_folders_on_one_host_share_the_stores_lock(tmp_path):
    """Two workers on one host under one id with different spool folders (two config files), no Redis: each took the
    lock beside its own spool and both ran every job. The lock beside the adapter store they share refuses the second,
    naming it; once the first lets go, the second takes the id. A store the worker cannot write to goes without it."""
    store = tmp_path / "store"
    first = _lease(tmp_path / "spool-a", None, store_dir=store)
    await first.acquire()
    second = _lease(tmp_path / "spool-b", None, store_dir=store, ttl_s=0.6, refresh_s=0.2)
    try:
        with pytest.raises(WorkerIdTaken) as taken:
            await second.acquire()
        assert "beside the adapter store" in str(taken.value) and f"pid {os.getpid()}" in str(taken.value), taken.value
        other_group = WorkerIdLease("gpu-0", "other-workers", tmp_path / "spool-c", store_dir=store, ttl_s=TTL_S,
                                    refresh_s=REFRESH_S)
        await other_group.acquire()  # the same id in another group is another member: not refused
        await other_group.release()
    finally:
        await first.release()
    await second.acquire()
    await second.release()
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    alone = _lease(tmp_path / "spool-d", None, store_dir=blocked)
    await alone.acquire()  # its store lock cannot be made: the spool folder's lock alone
    assert alone.store_lock_path is None
    await alone.release()
