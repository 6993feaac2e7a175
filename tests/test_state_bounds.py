"""A hostile producer cannot grow the worker's in-memory state without bound: tens of thousands of jobs, each with a
value of its own, or at a rate no window was sized for, leave each structure keyed by what producers send (circuit
breakers, the engine's per-tenant block counts) within a size fixed by the configuration."""

from __future__ import annotations

import time

from consumer.breaker import BreakerBoard
from tests.test_label_bounds import registry  # noqa: F401 - the fixture: acme, its adapter `support` and a rule


def test_a_flood_of_outcomes_in_one_window_keeps_the_breaker_small_and_fast():
    """50,000 outcomes of one adapter within its 60 s window (a busy adapter, ~830 jobs a second): the circuit held
    one (time, ok) pair per outcome and summed all of them at each one (O(n) memory, O(n^2) time: 20,000 took seconds);
    it now holds at most ~61 counts, and the rate it opens at is the same."""
    now = [0.0]
    board = BreakerBoard(failure_rate=0.5, min_requests=5, window_s=60, cooldown_s=10, clock=lambda: now[0])
    t0 = time.perf_counter()
    for i in range(50_000):
        now[0] = i * 0.0012  # 60 s in all
        board.record("acme/support@1", i % 3 != 0)  # a third fail: under the rate
    took = time.perf_counter() - t0
    circuit = board._circuits["acme/support@1"]
    assert len(circuit.outcomes) <= 62, len(circuit.outcomes)
    assert took < 2.0, took
    assert board.state("acme/support@1") == "closed"
    fails = board.failures("acme/support@1")
    assert 16_000 <= fails <= 16_667, fails  # the window's failures, within a bucket's share
    for _ in range(40_000):  # failures now outnumber the window's successes: it opens
        board.record("acme/support@1", False)
        if board.state("acme/support@1") == "open":
            break
    assert board.state("acme/support@1") == "open"
    now[0] += 200  # the window passed
    assert board.failures("acme/support@1") == 0


def test_the_breaker_counts_the_same_over_slow_traffic():
    """Outcomes seconds apart are each counted, each leaving the window window_s after it came (not sooner)."""
    now = [0.0]
    board = BreakerBoard(failure_rate=0.5, min_requests=3, window_s=10, cooldown_s=5, clock=lambda: now[0])
    for t, ok in ((0.0, False), (4.0, True), (8.0, False)):
        now[0] = t
        board.record("k", ok)
    assert board.failures("k") == 2 and board.state("k") == "open"
    now[0] = 10.0
    assert board.failures("k") == 2  # the first is 10 s old: still in
    now[0] = 10.5 + 10 / 60  # past its bucket's width too
    assert board.failures("k") == 1
    now[0] = 30.0
    assert board.failures("k") == 0


def test_tenants_that_left_the_kv_cache_leave_no_count_behind():
    """50,000 requests, each of a tenant of its own, run and freed (an engine driven with every job's tenant id, as
    `lorabatch generate` does with a file's): the per-tenant block count kept an entry at 0 for each tenant ever seen; it
    now holds the tenants holding blocks only, and a tenant's quota still counts its blocks while it holds them."""
    from engine.block_manager import BlockManager

    blocks = BlockManager(num_blocks=64, block_size=16, tenant_quota=8)
    for i in range(50_000):
        blocks.ensure(("r", i), 40, tenant_id=f"t{i}")
        assert blocks.tenant_blocks(f"t{i}") == 3
        blocks.free(("r", i))
    assert blocks._tenant_used == {} and blocks.tenants() == {}
    blocks.ensure("a", 16 * 8, tenant_id="acme")
    blocks.ensure("b", 16, tenant_id="globex")
    assert blocks.tenants() == {"acme": 8, "globex": 1}
    blocks.ensure("c", 0, tenant_id="acme")
    assert blocks.can_grow("c", 16) == "quota"
    blocks.free("a")
    assert blocks.tenants() == {"globex": 1} and blocks.can_grow("c", 16) is None


def test_fifty_thousand_hostile_jobs_leave_the_intake_within_its_bounds(registry):
    """50,000 jobs through the worker's real intake (parse, a registry on SQLite, the router, the scheduler), each with
    its own tenant id, request id, batch id, adapter name, user and session id: once answered, nothing is left waiting,
    the scheduler holds queues of registered tenants only, the route cache is at its bound, and the memory of answers
    and of messages read stays within worker.answered_cache."""
    import asyncio
    import json
    from types import SimpleNamespace

    from aiokafka import TopicPartition

    from consumer.config import Settings
    from consumer.intake import Intake
    from consumer.metrics import WorkerMetrics
    from consumer.route_cache import LruRouteCache
    from consumer.routing import Router
    from consumer.scheduler import Scheduler

    tp = TopicPartition("jobs", 0)
    settings = Settings.model_validate({"worker": {"answered_cache": 1_000}})
    scheduler, cache, breakers = Scheduler(64, 100_000, 8), LruRouteCache(500, 60), BreakerBoard()
    intake = Intake(settings, WorkerMetrics(), "w1", scheduler, Router(cache, breakers), None, None, asyncio.Event(),
                    registry.snapshot())
    emitted = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)

    async def nothing_stored(keys):
        return {}

    intake.stored = nothing_stored
    kinds = [
        lambda i: {"tenant_id": f"t{i}"},  # unregistered
        lambda i: {"tenant_id": "acme", "adapter_ref": f"ad{i}"},  # no such adapter
        lambda i: {"tenant_id": "acme", "user_id": f"u{i}", "session_id": f"s{i}", "prompt": "refund",
                   "priority": i % 201 - 100},  # queued, routed by the rule
    ]
    messages = [json.dumps({"request_id": f"r{i}", "batch_id": f"b{i}", "prompt": "x", **kinds[i % 3](i)}).encode()
                for i in range(50_000)]
    items = [(tp, SimpleNamespace(topic="jobs", partition=0, offset=k, timestamp=k, value=v, key=None, headers=[]), 1)
             for k, v in enumerate(messages)]
    for lo in range(0, len(items), 5_000):
        asyncio.run(intake.ingest(items[lo:lo + 5_000]))
    assert len(intake._seen) <= 2 * 1_000 and len(intake.answers) <= 1_000
    assert len(cache) <= 500
    assert set(scheduler.depth_by_tenant()) == {"acme"}
    assert set(scheduler._policies) <= {"acme"} and set(scheduler._buckets) <= {"acme"}
    assert len(scheduler._tiers) <= 201
    assert all(set(t.last_finish) <= {"acme"} for t in scheduler._tiers.values())
    assert breakers._circuits == {}
    queued = len(scheduler)
    assert len(intake.running) == queued and intake.parked == 0  # only the queued jobs' keys: the answered left
