"""AsyncEngine: callers await their own requests while one engine thread steps over everything submitted."""

from __future__ import annotations

import asyncio

import pytest

from engine.async_engine import AsyncEngine
from tests.test_serving_helpers import TEXTS, alone, demo_engine, req

ADAPTERS = ["qv-r4", "all-r16", "mlp-r64", None]


@pytest.fixture(scope="module")
def reference(demo_set):
    return demo_engine(demo_set, enable_prefix_caching=False)


@pytest.fixture
def engine(demo_set):
    return demo_engine(demo_set, register_only=True, max_num_batched_tokens=32)


async def test_staggered_callers_join_the_running_batch_and_get_their_own_tokens(engine, reference):
    """Twelve tasks submit at different times; the thread admits each between steps beside the decodes of earlier
    ones (a step holds a prefill row and decode rows at once), and each gets exactly the tokens it gets alone."""
    reqs = [req(f"a{i}", prompt=TEXTS[i % len(TEXTS)], adapter_key=ADAPTERS[i % 4], max_new_tokens=10 + i % 5,
                **({"temperature": 0.8, "seed": i} if i % 3 == 0 else {})) for i in range(12)]  # fmt: skip

    async def submit(i: int, r):
        await asyncio.sleep(0.004 * i)
        return await ae.generate(r)

    async with AsyncEngine(engine) as ae:
        results = await asyncio.gather(*(submit(i, r) for i, r in enumerate(reqs)))
        stats = await ae.stats()
        records = await ae.call(lambda e: e.pop_step_records())
    for r, res in zip(reqs, results):
        assert res.ok and res.request_id == r.request_id
        assert res.output_ids == alone(reference, r).output_ids, r.request_id
    assert stats["running"] == stats["waiting"] == 0 and stats["kv_pool_used_blocks"] == 0
    mixed = [rec for rec in records if any(s.tokens > 1 for s in rec.shares) and any(s.tokens == 1 for s in rec.shares)]
    assert mixed, "no step had a newcomer's prefill beside running decodes"


async def test_cancelling_the_caller_aborts_the_request(engine):
    """A cancelled `generate` re-raises CancelledError and its request leaves the engine, blocks and pins freed."""
    async with AsyncEngine(engine) as ae:
        task = asyncio.create_task(ae.generate(req("long", adapter_key="all-r16", max_new_tokens=32)))
        for _ in range(200):
            await asyncio.sleep(0.005)
            if (await ae.stats())["running"]:
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await ae.stats()
        for _ in range(100):
            if not stats["running"] and not stats["waiting"]:
                break
            await asyncio.sleep(0.005)
            stats = await ae.stats()
        assert stats["running"] == stats["waiting"] == 0
        assert stats["kv_pool_used_blocks"] == 0 and stats["lora_slots_pinned"] == 0
        after = await ae.generate(req("after", max_new_tokens=3))
        assert after.ok


async def test_abort_returns_the_partial_result_to_its_caller(engine):
    async with AsyncEngine(engine) as ae:
        task = asyncio.create_task(ae.generate(req("ab", max_new_tokens=32)))
        while not (await ae.stats())["running"]:
            await asyncio.sleep(0.002)
        await ae.abort("ab")
        res = await task
        assert res.error is not None and res.error.code == "aborted"
        assert await ae.abort("nobody") is None


async def test_a_failing_step_fails_the_requests_in_flight_and_the_loop_goes_on(engine, monkeypatch):
    """One step raising fails the requests in flight with engine_failed (retriable); later requests run."""
    real = engine.runner.forward
    calls = {"n": 0}

    def flaky(items, **kw):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device fault")
        return real(items, **kw)

    monkeypatch.setattr(engine.runner, "forward", flaky)
    async with AsyncEngine(engine) as ae:
        res = await ae.generate(req("victim", max_new_tokens=5))
        assert res.error is not None and res.error.code == "engine_failed" and res.error.retriable
        ok = await ae.generate(req("next", max_new_tokens=3))
        assert ok.ok and len(ok.output_ids) == 3
        assert (await ae.stats())["kv_pool_used_blocks"] == 0


async def test_duplicate_id_in_flight_and_engine_calls(engine, demo_set):
    """A second request with an id in flight fails alone; `call` runs engine methods in its thread, errors included."""
    async with AsyncEngine(engine) as ae:
        first = asyncio.create_task(ae.generate(req("dup", max_new_tokens=16)))
        await asyncio.sleep(0)  # the first is submitted; the copy right behind it (16 tokens may finish within a fixed wait)
        second = await ae.generate(req("dup", max_new_tokens=2))
        assert second.error.code == "duplicate_request_id"
        assert (await first).ok
        info = await ae.call(lambda e: e.load_adapter("eager", demo_set["adapters"]["qv-r16"]))
        assert info.tier in ("disk", "gpu") and await ae.call(lambda e: e.has_adapter("eager"))
        with pytest.raises(Exception) as err:
            await ae.call(lambda e: e.load_adapter("eager", demo_set["adapters"]["qv-r16"]))
        assert getattr(err.value, "code", None) == "adapter_key_in_use"


async def test_close_without_drain_aborts_what_runs(engine):
    """close(drain=False) answers every caller (aborted) before the thread ends; close() drains instead."""
    ae = AsyncEngine(engine)
    ae.start()
    task = asyncio.create_task(ae.generate(req("cut", max_new_tokens=32)))
    while not (await ae.stats())["running"]:
        await asyncio.sleep(0.002)
    await ae.close(drain=False)
    res = await task
    assert res.error.code == "aborted" and not engine.has_unfinished()
    ae = AsyncEngine(engine)
    ae.start()
    task = asyncio.create_task(ae.generate(req("whole", max_new_tokens=12)))
    await asyncio.sleep(0.005)
    await ae.close()
    assert (await task).ok and len(task.result().output_ids) == 12


async def test_a_cancelled_call_does_not_kill_the_engine_thread(demo_set):
    """A caller cancelled while its command waits in the queue must not crash the step loop (it did:
    InvalidStateError on a cancelled future ended the engine thread, and the worker hung on drain)."""
    import asyncio

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu"))
    aengine = AsyncEngine(engine)
    aengine.start()
    try:
        blocker = asyncio.ensure_future(aengine.call(lambda e: __import__("time").sleep(0.3)))
        await asyncio.sleep(0.05)  # the blocker runs in the engine thread now
        victim = asyncio.ensure_future(aengine.call(lambda e: e.stats()))
        await asyncio.sleep(0.01)
        victim.cancel()  # cancelled while still queued behind the blocker
        await blocker
        stats = await asyncio.wait_for(aengine.stats(), timeout=5)  # the thread is alive and answering
        assert "running" in stats
    finally:
        await aengine.close()


async def test_resident_adapters_are_published_by_the_engine_thread(engine):
    """`resident` is the engine thread's own snapshot of the adapters in device slots (the worker reads it from the
    event loop instead of calling the engine while it steps): empty before anything ran, current after a pass."""
    ae = AsyncEngine(engine)
    assert ae.resident == frozenset()
    async with ae:
        assert (await ae.generate(req("warm", adapter_key="all-r16", max_new_tokens=2))).ok
        expected = frozenset(await ae.call(lambda e: e.resident_adapters()))
        for _ in range(200):  # the snapshot follows at the end of the pass that ran the call
            if ae.resident == expected:
                break
            await asyncio.sleep(0.005)
        assert "all-r16" in expected and ae.resident == expected


async def test_the_resident_snapshot_follows_every_change_of_l1s_keys(engine, demo_set):
    """The snapshot is rebuilt only when L1's keys change (the pool counts the changes): a load, a second key for
    content already resident, an unload, and an eviction each show in it after the pass that made them."""

    async def settled(ae) -> frozenset:
        expected = frozenset(await ae.call(lambda e: e.resident_adapters()))
        for _ in range(200):
            if ae.resident == expected:
                break
            await asyncio.sleep(0.005)
        assert ae.resident == expected
        return expected

    path = demo_set["adapters"]["qv-r4"]
    async with AsyncEngine(engine) as ae:
        await ae.call(lambda e: e.load_adapter("first", path))
        assert "first" in await settled(ae)
        await ae.call(lambda e: e.register_adapter("alias", path))
        assert (await ae.generate(req("a", adapter_key="alias", max_new_tokens=1))).ok  # same content: linked, no load
        assert {"first", "alias"} <= await settled(ae)
        await ae.call(lambda e: e.unload_adapter("first"))
        snap = await settled(ae)
        assert "first" not in snap and "alias" in snap
        await ae.call(lambda e: e.adapters.offload())
        assert "alias" not in await settled(ae)


def test_alive_reads_the_thread_once_while_a_close_lets_it_go():
    """`alive` is asked from /readyz's thread while the event loop's close sets the step thread to None: it read it twice
    (`is not None`, then `.is_alive()`), and a close between the two made the probe raise AttributeError. It answers
    there now."""

    class _Thread:
        def is_alive(self) -> bool:
            return True

    class Closing(AsyncEngine):
        reads = 0

        @property
        def _thread(self):  # the close lands between the first read and the second
            type(self).reads += 1
            return _Thread() if type(self).reads == 1 else None

        @_thread.setter
        def _thread(self, value) -> None:
            pass

    e = Closing.__new__(Closing)
    assert e.alive in (True, False)
