"""Placements ahead of admission bounded by the work they overlap (engine.load_ahead_share): a load-ahead walk stops
placing at its deadline and only reads ahead after it; the requests it left are placed by a later walk or at their
admission, with the tokens of an unbounded engine."""

from __future__ import annotations

import pytest

import engine.planner as planner_module
from engine.engine import Engine
from tests.test_serving_helpers import NO_WARM, FakeClock, config, many_adapters, req  # noqa: F401 (a fixture)


def _engine(demo_set, many_adapters, n: int, **kw) -> Engine:
    eng = Engine(config(demo_set, max_batch_size=2, max_loras=12, adapter_loads_per_s=1e9, adapter_load_burst=10**6, **NO_WARM, **kw))
    for i in range(n):
        eng.register_adapter(f"k{i}", many_adapters[i])
    return eng


def test_a_walk_past_its_deadline_places_nothing_and_counts_a_cut(demo_set, many_adapters):
    eng = _engine(demo_set, many_adapters, 6)
    for i in range(6):
        eng.add_request(req(f"r{i}", adapter_key=f"k{i}"))
    eng.planner.prefetch((), 4, deadline_ns=0)  # long past
    assert eng.resident_adapters() == [] and eng.planner.load_ahead_cuts == 1
    eng.planner.prefetch((), 4, deadline_ns=None)
    assert sorted(eng.resident_adapters()) == ["k0", "k1", "k2", "k3"] and eng.planner.load_ahead_cuts == 1


def test_the_deadline_ends_placing_mid_walk_in_admission_order(demo_set, many_adapters, monkeypatch):
    """Each placement takes 1 µs of a fake clock; a deadline 2.5 µs on places the first three in line and no more, and
    the walk does not skip ahead to a later request once it stopped."""
    eng = _engine(demo_set, many_adapters, 6)
    for i in range(6):
        eng.add_request(req(f"r{i}", adapter_key=f"k{i}"))
    clock = [0]
    monkeypatch.setattr(planner_module.time, "perf_counter_ns", lambda: clock[0])
    place = eng.adapters.prefetch

    def slow(key, exclude):
        clock[0] += 1000
        return place(key, exclude)

    monkeypatch.setattr(eng.adapters, "prefetch", slow)
    eng.planner.prefetch((), 6, deadline_ns=2500)
    assert sorted(eng.resident_adapters()) == ["k0", "k1", "k2"] and eng.planner.load_ahead_cuts == 1


@pytest.mark.parametrize(("share", "covers_us", "bounded"), [(0.5, 2000.0, True), (None, 2000.0, False), (0.5, 0.0, False)])
def test_the_engine_gives_the_walk_its_share_of_the_launched_work(demo_set, many_adapters, monkeypatch, share, covers_us, bounded):
    """The deadline is the share of the launched work's device µs from now; none without a share or a measured step."""
    eng = _engine(demo_set, many_adapters, 1, load_ahead_share=share)
    got = []
    monkeypatch.setattr(eng.planner, "prefetch", lambda busy, places, deadline_ns=None: got.append(deadline_ns))
    before = planner_module.time.perf_counter_ns()
    eng._load_ahead(1, covers_us=covers_us)
    after = planner_module.time.perf_counter_ns()
    if not bounded:
        assert got == [None]
    else:
        assert before + 1_000_000 <= got[0] <= after + 1_000_000, (got, before, after)


def test_a_tiny_share_defers_placements_to_admission_and_changes_no_token(demo_set, many_adapters):
    """12 requests over 10 adapters, 2 at a time: with a share so small that every bounded walk stops before its first
    placement, each adapter is placed at its request's admission instead; every request gives the tokens it gives
    with no bound, and every one was charged its load."""
    reqs = [req(f"r{i}", adapter_key=f"k{i % 10}", max_new_tokens=4) for i in range(12)]

    def run(share):
        eng = _engine(demo_set, many_adapters, 10, load_ahead_share=share)
        place, ahead = eng.adapters.prefetch, []
        eng.adapters.prefetch = lambda key, exclude: ahead.append(r := place(key, exclude)) or r
        out = {r.request_id: r for r in eng.generate(reqs)}
        return eng, out, sum(isinstance(r, int) for r in ahead)

    bounded, got, placed_bounded = run(1e-9)
    free, want, placed_free = run(None)
    assert bounded.stats()["load_ahead_cuts"] > 0 and free.stats()["load_ahead_cuts"] == 0
    # placed ahead only before a prompt step's cost was fitted (no bound yet), the rest at their admission
    assert placed_bounded < placed_free, (placed_bounded, placed_free)
    assert all(r.ok for r in got.values()) and len(got) == 12
    assert {k: r.output_ids for k, r in got.items()} == {k: r.output_ids for k, r in want.items()}
    first = {f"r{i}" for i in range(10)}
    assert all(got[k].timings.adapter_load_us > 0 for k in first)


@pytest.mark.parametrize(("host_ms", "waited_ms", "decode_us", "want"),
                         [(5.0, 0.5, 1500.0, 3), (5.0, 4.0, 1500.0, 1), (0.2, 0.0, 1500.0, 1), (100.0, 0.0, 1500.0, 8),
                          (5.0, 0.0, 0.0, 1)])  # fmt: skip
def test_a_held_round_is_as_long_as_the_hosts_last_cycle(demo_set, many_adapters, monkeypatch, host_ms, waited_ms, decode_us, want):
    """The host's cycle since the last chained launch, less its waits for rounds' ends, in decode steps at the last one's
    measured µs, rounded: at least 1, at most decode_steps (8); 1 before a decode step was measured or outside a chain."""
    eng = _engine(demo_set, many_adapters, 1, decode_steps=8)
    assert eng._held_steps() == 1  # no chained launch yet
    monkeypatch.setattr(planner_module.time, "perf_counter_ns", lambda: 10**12)
    eng._launched_ns = 10**12 - int(host_ms * 1e6)
    eng._waited_ns, eng._decode_us = int(waited_ms * 1e6), decode_us
    assert eng._held_steps() == want


def test_a_held_round_takes_the_shorter_of_two_cycles_and_ends_by_the_holds_bound(demo_set, many_adapters, monkeypatch):
    """One long cycle after a short one does not lengthen the round (the shorter of the last two counts); and a hold
    under way whose bound ends within 2 steps cuts a round the host's cycle would make 6 steps long to 2 (the step in
    which the bound runs out, and the one under way)."""
    clock = FakeClock(100.0)
    eng = Engine(config(demo_set, max_batch_size=2, decode_steps=8, admission_hold_ms=40, **NO_WARM), clock=clock)
    monkeypatch.setattr(planner_module.time, "perf_counter_ns", lambda: 10**12)
    eng._decode_us = 1000.0

    def cycle(ms: float) -> int:
        eng._launched_ns, eng._waited_ns = 10**12 - int(ms * 1e6), 0
        return eng._held_steps()

    assert cycle(2.0) == 2 and cycle(6.0) == 2 and cycle(6.0) == 6 and cycle(3.0) == 3 and cycle(6.0) == 3
    assert cycle(6.0) == 6
    assert eng.planner.hold.hold(True, 1, 4)  # a hold begins now: its bound 40 ms on
    clock.t += 0.0385  # 1.5 ms left
    assert cycle(6.0) == 2
    clock.t += 1.0  # past the bound: a step under way at most
    assert cycle(6.0) == 1


def test_a_round_too_short_for_the_hosts_cycle_gets_no_placements(demo_set, many_adapters, monkeypatch):
    """A round launched at T covering 1.5 ms, and a host whose cycle besides placements took 1.2 ms: placements stop at
    T + 0.3 ms, before the share's T + 0.75 ms; a rest longer than the round leaves a deadline already past (none are
    placed, the walk counts a cut); with no rest measured yet, the share alone bounds the walk."""
    eng = _engine(demo_set, many_adapters, 1, load_ahead_share=0.5)
    got = []
    monkeypatch.setattr(eng.planner, "prefetch", lambda busy, places, deadline_ns=None: got.append(deadline_ns))
    now = 10**12
    monkeypatch.setattr(planner_module.time, "perf_counter_ns", lambda: now)
    eng._decode_us = 1500.0
    eng._launched_ns = now
    eng._under_round(1)
    assert got == [now + 750_000]  # no rest measured: the share
    for rest_ms, want in ((1.2, now + 300_000), (0.2, now + 750_000), (2.0, now - 500_000)):
        eng._rest_ns = int(rest_ms * 1e6)
        eng._under_round(1)
        assert got[-1] == want, (rest_ms, got[-1] - now)


def test_a_chained_launch_measures_the_hosts_rest_of_cycle(demo_set, many_adapters, monkeypatch):
    """The rest of a chained cycle is its time since the last launch less its waits for rounds and its placements, the
    shorter of the last two; a launch outside a chain (after an eager step) measures nothing."""
    import engine.engine as engine_module

    eng = _engine(demo_set, many_adapters, 1)
    clock = [10**12]
    monkeypatch.setattr(engine_module.time, "perf_counter_ns", lambda: clock[0])
    monkeypatch.setattr(engine_module, "launch_round", lambda *a, **k: "round")

    def cycle(ms: float, waited_ms: float = 0.0, placed_ms: float = 0.0) -> int | None:
        clock[0] += int(ms * 1e6)
        eng._waited_ns = int(waited_ms * 1e6)
        eng.adapters.placement_ns += int(placed_ms * 1e6)
        eng._launch_round([], [], 1)
        return eng._rest_ns

    assert cycle(5.0, placed_ms=1.0) is None  # the first launch: no cycle before it
    assert cycle(5.0, waited_ms=1.0, placed_ms=2.5) == 1_500_000
    assert cycle(4.0) == 1_500_000  # 4 ms: the shorter of the two counts
    assert cycle(3.0, placed_ms=1.0) == 2_000_000
    eng._launched_ns = None  # an eager step ended the chain
    assert cycle(9.0) == 2_000_000
