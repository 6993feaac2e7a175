"""A hostile producer cannot grow the worker's in-memory state without bound: tens of thousands of jobs, each with a
value of its own, or at a rate no window was sized for, leave each structure keyed by what producers send (circuit
breakers, the engine's per-tenant block counts) within a size fixed by the configuration."""

from __future__ import annotations

import time

from consumer.breaker import BreakerBoard


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
