"""What comes ahead of a request in the tiered adapter pool: the warm pool's predicted loads, prefetch into slots in
admission order, store reads ahead on threads and in reader processes, and L2 copies in the shared host arena."""

from __future__ import annotations

import os
import threading
import time

import pytest

from engine.engine import Engine
from tests.test_serving_helpers import NO_WARM, TEXTS, FakeClock, _slot_tensors, config, corrupt_copy, many_adapters, req  # noqa: F401 (a fixture)

DAY, HOUR = 86400, 3600


def test_the_warm_pool_loads_a_predicted_adapter_before_its_hour(demo_set, many_adapters):
    """An adapter used every morning at 09:xx for a week is loaded by the warm pool at 08:30 on day 8, into L2 and
    a free slot; the 09:05 request then finds it resident, pays no load, and counts as a warm-pool hit."""
    wall, mono = FakeClock(), FakeClock()
    eng = Engine(config(demo_set, max_loras=4, warm_pool_slots=2, warm_pool_interval_s=60), clock=mono, wall_clock=wall)
    eng.register_adapter("morning", many_adapters[3])
    eng.register_adapter("other", many_adapters[4])
    for day in range(7):
        for k in range(5):
            wall.t = day * DAY + 9 * HOUR + 60 * k
            eng.add_request(req(f"h{day}-{k}", adapter_key="morning"))
            eng.abort(f"h{day}-{k}")  # history only: the predictor saw the arrival
    assert eng.stats()["adapter_loads"]["disk"] == 0
    wall.t, mono.t = 7 * DAY + 8 * HOUR + 1800, 1000.0
    eng.step()
    events = eng.pop_load_events()
    assert [(e.key, e.tier, e.dest, e.reason) for e in events] == [("morning", "disk", "gpu", "warm_pool")]
    hits = eng.stats()["warm_pool_hits"]
    wall.t, mono.t = 7 * DAY + 9 * HOUR + 300, 2000.0
    res = eng.generate([req("at-nine", adapter_key="morning")])[0]
    assert res.ok and res.timings.adapter_load_us == 0
    assert eng.stats()["warm_pool_hits"] == hits + 1 and eng.stats()["warm_pool_prefetches_used"] == 1
    assert not [e for e in eng.pop_load_events() if e.tier != "gpu"]
    cold = eng.generate([req("cold", adapter_key="other")])[0]  # never predicted: a cold start, charged
    assert cold.timings.adapter_load_us > 0


def test_with_read_ahead_threads_the_warm_pool_reads_on_them_and_loads_at_its_next_pass(demo_set, many_adapters, monkeypatch):
    """The warm pool's store reads go to the read-ahead threads too: its pass starts the read and returns (the engine
    thread does not wait for the store); its next pass takes the result into L2 and a free slot."""
    import engine.adapter_records as records

    readers = []
    real = records.read_adapter

    def spy(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "read_adapter", spy)
    monkeypatch.setattr("engine.adapter_pool.read_adapter", spy)
    wall, mono = FakeClock(), FakeClock()
    eng = Engine(config(demo_set, max_loras=4, warm_pool_slots=2, warm_pool_interval_s=60, adapter_read_threads=1),
                 clock=mono, wall_clock=wall)  # fmt: skip
    eng.register_adapter("morning", many_adapters[3])
    for day in range(7):
        for k in range(5):
            wall.t = day * DAY + 9 * HOUR + 60 * k
            eng.add_request(req(f"h{day}-{k}", adapter_key="morning"))
            eng.abort(f"h{day}-{k}")
    wall.t, mono.t = 7 * DAY + 8 * HOUR + 1800, 1000.0
    eng.step()  # the pass starts the read on the thread
    assert not eng.pop_load_events() and "morning" not in eng.resident_adapters()
    for _ in range(500):
        if eng.adapters._ahead.done("morning"):
            break
        time.sleep(0.01)
    wall.t, mono.t = wall.t + 61, 1061.0
    eng.step()  # the next pass takes it
    events = eng.pop_load_events()
    assert [(e.key, e.tier, e.dest, e.reason) for e in events] == [("morning", "disk", "gpu", "warm_pool")]
    assert readers and all(name.startswith("adapter-read") for name in readers), readers


def test_prefetch_places_the_next_admissions_in_order_and_stops_at_the_first_refusal(demo_set, many_adapters):
    """After a step, the adapters of the waiting requests the next schedules can admit (here: as many as the running ones
    that end within the look-ahead) are placed in the slots the running requests do not hold, in admission order; the
    walk stops placing at the first request whose adapter finds no room (none after it is tried), and a later request
    never evicts an earlier one's adapter."""
    eng = Engine(config(demo_set, max_loras=4, max_batch_size=3, adapter_loads_per_s=1e9, adapter_load_burst=10**6, **NO_WARM))
    keys = [f"q{i}" for i in range(12)]
    for key, path in zip(keys, many_adapters[:12]):
        eng.register_adapter(key, path)
    for i, key in enumerate(keys):
        eng.add_request(req(f"r{i}", adapter_key=key, max_new_tokens=4))
    tried = _count_prefetches(eng)
    for _ in range(3):
        tried.clear()
        eng.step()
        running = [s.adapter_key for s in eng.planner.running]
        waiting = [s.adapter_key for s in sorted(eng.planner.waiting, key=lambda s: s.order)]
        assert len(running) == 3 and set(eng.resident_adapters()) == {*running, waiting[0]}, (running, waiting, eng.resident_adapters())
        assert tried == waiting[:2], tried  # one placed, the second refused (3 slots pinned, 1 free), nothing tried after it


def test_prefetch_places_nothing_while_no_running_request_ends_soon(demo_set, many_adapters):
    """With the batch full and every running request far from its max_new_tokens, no admission is near: a step places
    no waiting request's adapter (the host time would delay the GPU's work for nothing); once they near their end, the
    next ones are placed."""
    # No time bound on placing ahead (load_ahead_share None): on a loaded host the step's measured CPU time left room for
    # q2's placement but not q3's, and this test is about when placing starts, not how much of a step it may take.
    eng = Engine(config(demo_set, max_loras=8, max_batch_size=2, decode_steps=2, adapter_loads_per_s=1e9, adapter_load_burst=10**6,
                        load_ahead_share=None, **NO_WARM))
    for i, path in enumerate(many_adapters[:4]):
        eng.register_adapter(f"q{i}", path)
        eng.add_request(req(f"r{i}", adapter_key=f"q{i}", max_new_tokens=12))
    tried = _count_prefetches(eng)
    steps = 0
    while not tried:
        eng.step()  # the first admits r0 and r1 (their first tokens)
        steps += 1
        assert steps > 1 or set(eng.resident_adapters()) == {"q0", "q1"}
    # placed in the step that starts with 5 tokens left (12 - 7 made): this step's one and 2 rounds of 2 steps after it
    assert steps == 8 and tried[:2] == ["q2", "q3"] and {"q2", "q3"} <= set(eng.resident_adapters()), (steps, tried)


def test_queued_adapters_are_read_ahead_though_not_placed(demo_set, many_adapters):
    """With read-ahead threads, the adapters of waiting requests that the next schedule cannot admit are read from the
    store on the threads (into L2, no slot taken), so their admission only copies them."""
    eng = Engine(config(demo_set, max_loras=8, max_batch_size=2, adapter_read_threads=2, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, **NO_WARM))  # fmt: skip
    for i, path in enumerate(many_adapters[:5]):
        eng.register_adapter(f"q{i}", path)
        eng.add_request(req(f"r{i}", adapter_key=f"q{i}", max_new_tokens=30))
    tried = _count_prefetches(eng)
    for _ in range(200):  # the first admissions wait for their reads too (the engine thread never reads the store)
        eng.step()
        if set(eng.resident_adapters()) == {"q0", "q1"}:
            break
        time.sleep(0.01)
    ahead = eng.adapters._ahead
    assert set(tried) <= {"q0", "q1"} and all(ahead.pending(f"q{i}") or ahead.done(f"q{i}") for i in (2, 3, 4)), tried
    assert set(eng.resident_adapters()) == {"q0", "q1"}
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
    assert all(r.ok for r in results.values()) and len(results) == 5
    disk = [e for e in eng.pop_load_events() if e.tier == "disk" and e.skip_reason is None]
    assert sorted(e.key for e in disk) == [f"q{i}" for i in range(5)]  # each read once


def test_with_read_ahead_threads_the_engine_thread_never_reads_the_store(demo_set, many_adapters, monkeypatch):
    """Admissions and placements wait for reads on the read-ahead threads (WAIT_READ) rather than reading on the engine
    thread, even when more adapters are needed than the threads have room for; every request still runs."""
    import engine.adapter_records as records

    readers = []
    real = records.read_adapter

    def spy(*args, **kwargs):
        readers.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(records, "read_adapter", spy)  # what the threads call
    monkeypatch.setattr("engine.adapter_pool.read_adapter", spy)  # what the engine thread would call
    eng = Engine(config(demo_set, max_loras=8, max_batch_size=4, adapter_read_threads=1, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, **NO_WARM))  # fmt: skip
    n = 8  # twice the reads one thread has room for ahead (MAX_AHEAD_PER_THREAD)
    for i, path in enumerate(many_adapters[:n]):
        eng.register_adapter(f"q{i}", path)
        eng.add_request(req(f"r{i}", adapter_key=f"q{i}", max_new_tokens=4))
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
        time.sleep(eng.idle_wait_s())
    assert len(results) == n and all(r.ok for r in results.values()), results
    assert len(readers) == n and all(name.startswith("adapter-read") for name in readers), readers


def test_admission_skips_a_request_whose_adapter_waits_for_a_read_before_any_lookup(demo_set, many_adapters, monkeypatch):
    """`waits_for_read`: with read-ahead threads, an adapter in neither L1 nor L2 whose read is under way, or cannot start
    for want of room, makes admission skip its request at once (no prefix-cache lookup); a finished read, a resident
    adapter, or no threads at all do not."""
    import threading

    from engine import adapter_records
    from engine.adapter_records import MAX_AHEAD_PER_THREAD

    # The reads wait for the test: a tiny adapter's read could end (and free its room) before the last one is asked for.
    release = threading.Event()
    real_read = adapter_records.read_adapter
    monkeypatch.setattr(adapter_records, "read_adapter", lambda *a: release.wait(30) and real_read(*a))
    eng = Engine(config(demo_set, max_loras=8, max_batch_size=8, adapter_read_threads=1, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, **NO_WARM))  # fmt: skip
    pool = eng.adapters
    n = MAX_AHEAD_PER_THREAD + 1
    for i, path in enumerate(many_adapters[:n]):
        eng.register_adapter(f"q{i}", path)
    started = [pool.read_ahead(f"q{i}") for i in range(n)]
    assert started == [True] * (n - 1) + [None]  # the last: needed, no room
    assert pool.waits_for_read(f"q{n - 1}")  # not started: no room
    looked = []
    lookup = eng.planner._lookup
    monkeypatch.setattr(eng.planner, "_lookup", lambda seq: looked.append(seq.adapter_key) or lookup(seq))
    waiting = {f"q{i}" for i in range(n) if pool.waits_for_read(f"q{i}")}
    for i in range(n):
        eng.add_request(req(f"r{i}", adapter_key=f"q{i}", max_new_tokens=2))
    eng.step()
    assert not (set(looked) & waiting), (looked, waiting)
    release.set()
    for _ in range(500):
        if all(pool._ahead.done(f"q{i}") for i in range(n - 1)):
            break
        time.sleep(0.01)
    assert not any(pool.waits_for_read(f"q{i}") for i in range(n - 1))  # read: acquire takes it
    results = {}
    while eng.has_unfinished():
        for r in eng.step():
            results[r.request_id] = r
        time.sleep(eng.idle_wait_s())
    assert len(results) == n and all(r.ok for r in results.values())
    assert not pool.waits_for_read("q0")  # resident now
    plain = Engine(config(demo_set, max_loras=8, **NO_WARM))
    plain.register_adapter("q0", many_adapters[0])
    assert not plain.adapters.waits_for_read("q0")  # no threads: the engine thread reads


def _count_prefetches(eng) -> list[str]:
    """The keys the engine asks the pool to place ahead, in order (the list fills as it steps)."""
    tried = []
    prefetch = eng.adapters.prefetch

    def counted(key, exclude):
        tried.append(key)
        return prefetch(key, exclude)

    eng.adapters.prefetch = counted
    return tried


@pytest.mark.parametrize("pages", ["in_place", "over_pipes"])
def test_reads_in_reader_processes_serve_the_same_tokens_and_errors(demo_set, many_adapters, tmp_path, monkeypatch, pages):
    """With store reads in reader processes (engine.adapter_reader): requests queued behind a full batch have their
    adapters read there and give the tokens of an engine reading in-process; a corrupt file and a changed one fail their
    requests with their codes; a reader process killed mid-run is replaced and no read is lost; the processes stop with
    the pool. The pages are written in place into the shared L2 arena, or, where /dev/shm cannot hold it, sent over
    the processes' pipes."""
    bad = corrupt_copy(demo_set["adapters"]["qv-r4"], tmp_path / "bad")
    keys = [f"p{i}" for i in range(6)]
    reqs = [req(f"r{i}", adapter_key=keys[i % 6], max_new_tokens=3) for i in range(10)]
    reqs += [req("corrupt", adapter_key="bad", max_new_tokens=3), req("changed", adapter_key="moved", max_new_tokens=3)]

    def run(**extra):
        eng = Engine(config(demo_set, max_batch_size=2, max_loras=4, adapter_loads_per_s=1e9, adapter_load_burst=10**6, **NO_WARM, **extra))
        for key, path in zip(keys, many_adapters[:6]):
            eng.register_adapter(key, path)
        eng.register_adapter("bad", bad)
        eng.register_adapter("moved", many_adapters[7], sha256="0" * 64)
        for r in reqs:
            eng.add_request(r)
        out, steps = {}, 0
        while eng.has_unfinished():
            for r in eng.step():
                out[r.request_id] = r
            steps += 1
            reader = eng.adapters._ahead.reader
            if steps == 2 and reader is not None:
                reader._workers[0][0].kill()
        return eng, out

    ref_eng, ref = run()
    if pages == "over_pipes":
        real = os.statvfs
        monkeypatch.setattr("engine.host_arena.os.statvfs", lambda p: os.statvfs_result((*real(p)[:4], 0, *real(p)[5:])))
    eng, got = run(adapter_read_processes=2)
    reader = eng.adapters._ahead.reader
    assert reader is not None and eng.adapters._ahead.threads == 2
    assert (eng.runner.lora.arena.name is not None) == (pages == "in_place")
    assert (reader.written_in_place, reader.sent_over_pipe)[pages == "over_pipes"] >= 6  # every good read
    assert (reader.written_in_place, reader.sent_over_pipe)[pages == "in_place"] == 0
    for i in range(10):
        assert got[f"r{i}"].ok and got[f"r{i}"].output_ids == ref[f"r{i}"].output_ids, i
    assert got["corrupt"].error.code == ref["corrupt"].error.code == "adapter_corrupt"
    assert got["changed"].error.code == ref["changed"].error.code == "adapter_changed"
    assert "corrupt or truncated" in got["corrupt"].error.message
    disk = [e for e in eng.pop_load_events() if e.tier == "disk" and e.skip_reason is None and e.error_code is None]
    assert sorted({e.key for e in disk}) == keys and len(disk) == 6  # each good adapter read once, none lost to the kill
    procs = [p for p, _ in reader._workers]
    assert len(procs) == 2 and all(p.is_alive() for p in procs)
    eng.adapters.close()
    assert not any(p.is_alive() for p in procs) and eng.adapters._ahead.reader is None


def test_l2_copies_live_in_the_host_arena_and_a_full_arena_falls_back(demo_set, many_adapters):
    """L2 copies are extents of the host arena taken at start (no allocation per read); with an arena too small for
    them, copies take tensors of their own (counted as misses); either way the tokens are those of an engine with no
    arena, and evicted adapters' extents come back."""
    from engine.host_arena import HostArena

    reqs = [req(f"a{i}", prompt=TEXTS[i % len(TEXTS)][:30], adapter_key=f"k{i % 8}", max_new_tokens=3) for i in range(24)]

    def run(arena):
        eng = Engine(config(demo_set, max_loras=4, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000, **NO_WARM))
        lora = eng.runner.lora
        if arena != "default":
            lora.arena = arena(lora) if arena else None
        for i, path in enumerate(many_adapters[:8]):
            eng.register_adapter(f"k{i}", path)
        return eng, {r.request_id: r.output_ids for r in eng.generate(reqs)}

    _, want = run(None)
    eng, got = run("default")
    arena = eng.runner.lora.arena
    assert got == want and arena is not None and eng.stats()["adapter_host_arena_misses"] == 0
    block = arena._block
    lo, hi = block.data_ptr(), block.data_ptr() + block.numel() * block.element_size()
    held = [c.host for c in eng.adapters._contents.values() if c.host is not None]
    assert len(held) == 8 and all(lo <= h.data.data_ptr() < hi for h in held)
    room = sum(h.nbytes for h in held) // 3  # for two or three of the 8
    eng2, got2 = run(lambda lora: HostArena(room, lora.dtype))
    assert got2 == want and eng2.stats()["adapter_host_arena_misses"] > 0
