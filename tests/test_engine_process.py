"""EngineProcess: the step loop in a child process, with AsyncEngine's face; its death and its bad inputs."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import sys
import time

import pytest

from engine.api import EngineError
from engine.config import EngineConfig
from engine.engine_process import GIL_SWITCH_S, EngineProcess
from tests.test_serving_helpers import TEXTS, alone, config, demo_engine, req

ADAPTERS = ["qv-r4", "all-r16", "mlp-r64", None]


def _register_all(engine, adapters: dict) -> None:
    for name, path in adapters.items():
        engine.register_adapter(name, path)


def _resident(engine) -> list[str]:
    return engine.resident_adapters()


def _boom(engine, message: str) -> None:
    raise ValueError(message)


def _unpicklable_answer(engine):
    return lambda: None


def _load(engine, key: str, path) -> str:
    return engine.load_adapter(key, path).tier


def _child_pid(engine) -> int:
    return os.getpid()


def _switch_interval(engine) -> float:
    return sys.getswitchinterval()


def _hang(engine) -> None:
    time.sleep(3600)  # a child stuck in a hung GPU call answers nothing more


@pytest.fixture(scope="module")
def reference(demo_set):
    return demo_engine(demo_set, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def proc(demo_set):
    """One child for the tests that leave it healthy (each spawn imports torch and builds the model: seconds)."""
    p = EngineProcess(config(demo_set, max_num_batched_tokens=32))
    p.start()
    asyncio.run(p.call(functools.partial(_register_all, adapters=demo_set["adapters"])))
    yield p
    asyncio.run(p.close())


def _fresh(demo_set, **kw) -> EngineProcess:
    p = EngineProcess(config(demo_set, **kw))
    p.start()
    return p


async def test_requests_from_many_callers_get_the_tokens_they_get_alone(proc, reference):
    """Twelve staggered callers, adapters mixed with the base, sampled and greedy: each result is exactly the one
    the request gets alone in this process, and it runs in another process."""
    reqs = [req(f"a{i}", prompt=TEXTS[i % len(TEXTS)], adapter_key=ADAPTERS[i % 4], max_new_tokens=6 + i % 5,
                **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})) for i in range(12)]  # fmt: skip

    async def submit(i: int, r):
        await asyncio.sleep(0.003 * i)
        return await proc.generate(r)

    results = await asyncio.gather(*(submit(i, r) for i, r in enumerate(reqs)))
    for r, res in zip(reqs, results):
        assert res.ok, res.error
        assert res.output_ids == alone(reference, r).output_ids, r.request_id
    assert await proc.call(_child_pid) == proc.pid != os.getpid()
    # the step loop yields the GIL to the adapter read-ahead threads only every GIL_SWITCH_S, the worker keeps its own
    assert await proc.call(_switch_interval) == pytest.approx(GIL_SWITCH_S) != sys.getswitchinterval()
    stats = await proc.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pool_used_blocks"] == 0


async def test_duplicate_ids_in_flight_and_the_same_id_of_two_tenants(proc):
    """A second request with an id in flight fails alone (duplicate_request_id); another tenant's same id runs."""
    first = asyncio.create_task(proc.generate(req("dup", max_new_tokens=24)))
    await asyncio.sleep(0)  # the first is sent; the copy right behind it (24 tokens may finish within a fixed wait)
    second, other = await asyncio.gather(proc.generate(req("dup", max_new_tokens=2)),
                                         proc.generate(req("dup", tenant_id="globex", max_new_tokens=2)))
    assert second.error is not None and second.error.code == "duplicate_request_id"
    assert other.ok and (await first).ok


async def test_cancel_and_abort_free_the_request_and_its_id(proc):
    """A cancelled caller's request is aborted in the child (blocks freed); the id can be used again at once;
    abort() hands back the partial result, and None for an id nobody runs."""
    task = asyncio.create_task(proc.generate(req("c1", max_new_tokens=32)))
    while not (await proc.stats())["running"]:
        await asyncio.sleep(0.002)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    again = await proc.generate(req("c1", max_new_tokens=3))  # queued behind the abort: the key is free by then
    assert again.ok and len(again.output_ids) == 3
    task = asyncio.create_task(proc.generate(req("c2", max_new_tokens=32)))
    while not (await proc.stats())["running"]:
        await asyncio.sleep(0.002)
    partial = await proc.abort("c2")
    res = await task
    assert partial is not None and res.error.code == "aborted" and partial.output_ids == res.output_ids
    assert await proc.abort("nobody") is None
    stats = await proc.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pool_used_blocks"] == 0


async def test_calls_raise_what_the_engine_raised_and_refuse_what_cannot_travel(proc, demo_set):
    """An exception in the child reaches the caller with its type and code; a lambda is refused before it is sent;
    an answer that cannot be pickled raises TypeError; the child answers on after each."""
    with pytest.raises(ValueError, match="kaputt"):
        await proc.call(functools.partial(_boom, message="kaputt"))
    with pytest.raises(EngineError) as err:
        await proc.call(functools.partial(_load, key="qv-r4", path=demo_set["adapters"]["qv-r4"]))
    assert err.value.code == "adapter_key_in_use"
    with pytest.raises(TypeError, match="pickle"):
        await proc.call(lambda e: e.stats())
    with pytest.raises(TypeError, match="does not pickle"):
        await proc.call(_unpicklable_answer)
    assert (await proc.generate(req("after-errors", max_new_tokens=2))).ok


async def test_resident_follows_the_childs_slots(proc, demo_set):
    """`resident` is the child's report of the adapters in device slots, updated after the pass that changed them."""
    await proc.call(functools.partial(_load, key="eager", path=demo_set["adapters"]["qv-r16"]))
    expected = frozenset(await proc.call(_resident))
    for _ in range(400):
        if proc.resident == expected:
            break
        await asyncio.sleep(0.005)
    assert "eager" in expected and proc.resident == expected


async def test_a_killed_child_fails_what_waits_and_every_later_call(demo_set):
    """SIGKILL mid-request (the OOM killer, a driver crash): the caller gets engine_failed (retriable) at once, not a
    hang; `alive` turns False; later generates and calls fail the same way; close() still returns."""
    p = _fresh(demo_set)
    try:
        task = asyncio.create_task(p.generate(req("victim", max_new_tokens=32)))
        while not (await p.stats())["running"]:
            await asyncio.sleep(0.002)
        os.kill(p.pid, signal.SIGKILL)
        res = await asyncio.wait_for(task, 30)
        assert res.error is not None and res.error.code == "engine_failed" and res.error.retriable
        assert "exited" in res.error.message
        for _ in range(100):
            if not p.alive:
                break
            await asyncio.sleep(0.01)
        assert not p.alive
        later = await p.generate(req("later", max_new_tokens=2))
        assert later.error.code == "engine_failed"
        with pytest.raises(EngineError) as err:
            await p.stats()
        assert err.value.code == "engine_failed"
    finally:
        await asyncio.wait_for(p.close(), 30)


async def test_a_killed_child_leaves_no_l2_arena_in_dev_shm(demo_set):
    """A child with reader processes keeps its L2 arena in /dev/shm; killed, it cannot unlink it, and the arena stayed
    there (host_cache_bytes and a quarter of host memory) until the worker exited, one more at each restart."""
    from engine.host_arena import SHM_DIR

    p = _fresh(demo_set, adapter_read_processes=1, adapter_read_threads=1, host_cache_bytes=8 << 20)
    try:
        pid = p.pid
        mine = [n for n in os.listdir(SHM_DIR) if n.startswith(f"lorabatch-l2-{pid}-")]
        assert len(mine) == 1, mine
        os.kill(pid, signal.SIGKILL)
        for _ in range(1_000):  # `died`, not `alive`: the process ends before its reader thread marks it dead
            if p.died:
                break
            await asyncio.sleep(0.01)
        await asyncio.wait_for(p.restart(), 120)
        assert not os.path.exists(os.path.join(SHM_DIR, mine[0]))
        assert len([n for n in os.listdir(SHM_DIR) if n.startswith(f"lorabatch-l2-{p.pid}-")]) == 1  # the new child's
    finally:
        await asyncio.wait_for(p.close(), 30)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(f"lorabatch-l2-{p.pid}-")]


async def test_close_drains_or_aborts_and_the_child_exits(demo_set):
    """close() lets what runs finish; close(drain=False) answers every caller with `aborted`; the child exits both
    times and the handle reports not alive."""
    p = _fresh(demo_set)
    task = asyncio.create_task(p.generate(req("whole", max_new_tokens=12)))
    await asyncio.sleep(0.01)
    await p.close()
    assert (await task).ok and len(task.result().output_ids) == 12 and not p.alive
    p = _fresh(demo_set)
    pid = p.pid
    task = asyncio.create_task(p.generate(req("cut", max_new_tokens=32)))
    while not (await p.stats())["running"]:
        await asyncio.sleep(0.002)
    await p.close(drain=False)
    res = await task
    assert res.error.code == "aborted" and not p.alive
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_a_close_with_a_deadline_kills_a_child_that_answers_nothing(demo_set):
    """A hung child (a GPU call that never returns) cannot take close(drain=False)'s abort: with `timeout_s` the close
    kills it and returns within the deadline (a worker's stop fits its grace period); its callers get an error."""
    p = _fresh(demo_set)
    pid = p.pid
    hung = asyncio.create_task(p.call(_hang))
    task = asyncio.create_task(p.generate(req("stuck", max_new_tokens=8)))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await asyncio.wait_for(p.close(drain=False, timeout_s=1.0), 20)
    assert time.monotonic() - t0 < 10
    assert not p.alive and not p.started
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert (await asyncio.wait_for(task, 10)).error is not None
    with pytest.raises(EngineError):
        await asyncio.wait_for(hung, 10)


async def _restart_cancelled_while_building(demo_set) -> tuple[EngineProcess, set[int]]:
    """A child killed, its restart cancelled while the new child loads its model (a worker's stop arriving then); the
    handle, and the pids of the children alive before."""
    p = _fresh(demo_set)
    before = {c.pid for c in multiprocessing.active_children()}
    os.kill(p.pid, signal.SIGKILL)
    for _ in range(500):
        if p.died:
            break
        await asyncio.sleep(0.01)
    assert p.died
    restart = asyncio.create_task(p.restart())
    await asyncio.sleep(0.05)  # the new child is spawned and building its engine
    restart.cancel()
    with pytest.raises(asyncio.CancelledError):
        await restart
    return p, before


def _new_children(before: set[int]) -> list:
    return [c for c in multiprocessing.active_children() if c.name == "lorabatch-engine" and c.pid not in before]


async def test_a_restart_cancelled_while_the_child_builds_leaves_no_child(demo_set):
    """The worker's stop can cancel a restart whose new child is still loading its model: close() then waits for
    that start and stops what it made, so no engine is left holding memory (or a GPU) behind a closed handle."""
    p, before = await _restart_cancelled_while_building(demo_set)
    await asyncio.wait_for(p.close(), 60)
    assert not p.started
    assert not _new_children(before), "the restart's child outlived the close"


async def test_a_close_that_will_not_wait_for_a_restarts_start_ends_what_it_makes(demo_set):
    """A worker's stop with a deadline shorter than a restart's model load: close returns by its deadline, and the
    start it gave up on kills the child it made (no engine left holding memory or a GPU, however the loop ends)."""
    p, before = await _restart_cancelled_while_building(demo_set)
    t0 = time.monotonic()
    await p.close(drain=False, timeout_s=0.2)
    assert time.monotonic() - t0 < 5
    for _ in range(300):  # the start notices within its poll (0.5 s), or once the child answers
        if not _new_children(before):
            break
        await asyncio.sleep(0.1)
    assert not _new_children(before), "the abandoned start's child is still running"
    assert not p.started


def test_a_child_that_cannot_build_its_engine_says_why(tmp_path):
    """A model folder that is not there: start() raises the engine's own error, and no child is left behind."""
    p = EngineProcess(EngineConfig(model_dir=str(tmp_path / "no-model"), device="cpu"))
    with pytest.raises(Exception) as err:
        p.start()
    assert "no-model" in str(err.value)
    assert not p.started and not p.alive


def test_the_child_exits_when_its_parent_goes(demo_set, tmp_path):
    """A parent killed outright (no close) leaves no engine behind: the child sees its command pipe close."""
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from engine.engine_process import EngineProcess\n"
        "from engine.config import EngineConfig\n"
        "if __name__ == '__main__':\n"
        f"    p = EngineProcess(EngineConfig(model_dir={str(demo_set['model'])!r}, device='cpu'))\n"
        "    p.start()\n"
        "    print(p.pid, flush=True)\n"
        "    time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait()
        for _ in range(300):
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{child}/stat") as f:  # a zombie (exited, not yet reaped by init) counts as gone
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the engine child outlived its parent")
    finally:
        parent.kill()


def test_alive_reads_the_child_once_while_a_close_lets_it_go():
    """`alive` is asked from /readyz's thread while the event loop's close sets the child's handle to None: it read the
    handle twice (`is not None`, then `.is_alive()`), and a close between the two made the probe raise AttributeError
    ('NoneType' object has no attribute 'is_alive'). It answers False there now."""

    class _Child:
        def is_alive(self) -> bool:
            return True

    class Closing(EngineProcess):
        reads = 0

        @property
        def _proc(self):  # the close lands between the first read and the second
            type(self).reads += 1
            return _Child() if type(self).reads == 1 else None

        @_proc.setter
        def _proc(self, value) -> None:
            pass

    e = Closing.__new__(Closing)
    e._dead = None
    assert e.alive in (True, False)
