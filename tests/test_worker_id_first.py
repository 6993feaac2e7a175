"""`lorabatch worker --worker-id X` takes X before it builds its engine (consumer.cli.worker): a second worker under a held
id exits with status 2 without building an engine (a model on a GPU: minutes for nothing), and a worker building its
engine holds its id all along, its lease refreshed past the TTL, and gives it back when the build fails.

Real `lorabatch worker` processes with a fake engine build (EngineProcess.start patched) and short lease times; the
Redis lease in db 10 of the machine's Redis."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
import redis

from consumer.worker_lease import WorkerIdLease, WorkerIdTaken

REDIS_URL = "redis://127.0.0.1:6379/10"
TTL_S, REFRESH_S = 1.5, 0.3


def _worker(tmp_path: Path, config: str, built: Path, go: Path) -> subprocess.Popen:
    """`lorabatch worker --worker-id dup` whose engine build writes `built`, waits for `go` to exist, then fails."""
    code = textwrap.dedent(f"""
        import pathlib, sys, time
        import consumer.worker_lease as lease
        from engine.api import EngineError
        from engine.engine_process import EngineProcess
        lease.LEASE_TTL_S, lease.REFRESH_S = {TTL_S}, {REFRESH_S}
        def start(self, abandon=None):
            pathlib.Path({str(built)!r}).write_text("built")
            while not pathlib.Path({str(go)!r}).exists():
                time.sleep(0.05)
            raise EngineError("the fake engine fails its build", code="engine_failed")
        EngineProcess.start = start
        sys.argv = ["lorabatch", "worker", "--config", {config!r}, "--worker-id", "dup"]
        from consumer.cli import main
        main()
    """)
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _config(tmp_path: Path, extra: str = "") -> str:
    path = tmp_path / "lorabatch.toml"
    path.write_text(f'[worker]\nspool_path = "{tmp_path / "spool" / "spool.sqlite"}"\n{extra}')
    return str(path)


async def test_a_held_id_is_refused_before_the_engine_is_built(tmp_path):
    """A second worker under an id that a live worker holds exits with status 2, naming the id and the fix, and never
    calls the engine's build."""
    holder = WorkerIdLease("dup", "lorabatch-workers", tmp_path / "spool")
    await holder.acquire()
    built, go = tmp_path / "built", tmp_path / "go"
    go.write_text("")  # a build, if one began, ends at once
    try:
        proc = _worker(tmp_path, _config(tmp_path), built, go)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=120)
    finally:
        await holder.release()
    assert proc.returncode == 2, out
    assert f"worker id dup is held by a live worker (host " in out and f"pid {os.getpid()}" in out, out
    assert "another --worker-id" in out, out
    assert not built.exists(), out


@pytest.fixture
def prefix():
    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis at 127.0.0.1:6379")
    prefix = f"test-idfirst-{uuid.uuid4().hex[:8]}"
    yield prefix
    for key in client.scan_iter(f"{prefix}:*"):
        client.delete(key)
    client.close()


async def test_the_id_is_held_while_the_engine_is_built(tmp_path, prefix):
    """While the engine builds (here three lease TTLs), the id's Redis lease stays this worker's, so a worker on another
    host is refused it; a build that fails gives it back."""
    client = redis.Redis.from_url(REDIS_URL)
    key = f"{prefix}:worker:lorabatch-workers:dup"
    built, go = tmp_path / "built", tmp_path / "go"
    cfg = _config(tmp_path, f'[routing]\ncache = "redis"\nredis_url = "{REDIS_URL}"\nredis_prefix = "{prefix}"\n')
    proc = _worker(tmp_path, cfg, built, go)
    try:
        deadline = time.monotonic() + 120
        while not built.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else ""
            await asyncio.sleep(0.05)
        await asyncio.sleep(3 * TTL_S)  # the build outlasts the lease's TTL
        held = client.get(key)
        assert held is not None and f'"pid": {proc.pid}' in held.decode(), held
        other = WorkerIdLease("dup", "lorabatch-workers", tmp_path / "host-b", redis_url=REDIS_URL, prefix=prefix,
                              ttl_s=TTL_S, refresh_s=REFRESH_S)
        try:
            with pytest.raises(WorkerIdTaken):
                await other.acquire()
        finally:
            await other.release()
        go.write_text("")
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 2 and "the fake engine fails its build" in out, out
        assert client.get(key) is None  # given back at the exit, not left to lapse
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        client.close()
