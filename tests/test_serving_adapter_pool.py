"""The tiered adapter pool: churn through few slots, exact load counts by tier, dedupe, admission rate limit,
failed loads (fail or fall back), pinning, the eviction score, and the warm pool's predictor."""

from __future__ import annotations

import math
import os
import random
import shutil
import threading
import time
from collections import Counter, defaultdict

import pytest
from safetensors.torch import load_file, save_file

from engine.adapter_policy import (
    HEAT_WINDOW_S,
    Candidate,
    Heat,
    TokenBucket,
    choose_victim,
    keep_score,
)
from engine.adapters import FINGERPRINT_KEY
from engine.demo_model import write_demo_adapter
from engine.engine import Engine
from engine.model import LORA_TARGETS
from engine.store import content_sha256
from engine.warm_pool import TrafficPredictor
from tests.test_serving_helpers import TEXTS, alone, config, req, run_until_done

TARGET_SETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"), LORA_TARGETS]
RANKS = [4, 8, 16, 64]
NO_WARM = dict(warm_pool_slots=0, warm_pool_host_bytes=0)


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def many_adapters(demo_set, tmp_path_factory) -> list:
    """200 adapters of the demo model: ranks 4..64 and four target sets, mixed."""
    root = tmp_path_factory.mktemp("many")
    paths = []
    for i in range(200):
        path = root / f"ad{i:03d}"
        write_demo_adapter(path, demo_set["model"], rank=RANKS[i % 4], target_modules=TARGET_SETS[(i // 4) % 4],
                           alpha=2.0 * RANKS[i % 4], use_rslora=i % 7 == 0, seed=5000 + i)  # fmt: skip
        paths.append(path)
    return paths


def _slot_tensors(engine: Engine) -> list:
    lora = engine.runner.lora
    return [lora.pool, lora.pages, lora.rank, lora.scale]


def test_churn_200_adapters_through_8_slots(demo_set, many_adapters):
    """160 requests over 200 adapters (zipf popularity, mixed ranks and targets) through 8 slots, arriving while
    others run: every output equals the request run with its adapter freshly loaded; each adapter is read from
    disk once (L2 holds them all), every other placement is an L2 copy, placements = evictions + resident; and
    the slot tensors are the ones allocated at start (no allocation on the hot path)."""
    rng = random.Random(11)
    eng = Engine(config(demo_set, max_loras=8, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000,
                        max_batch_size=16, **NO_WARM))  # fmt: skip
    for i, path in enumerate(many_adapters):
        sha = None
        if i % 2:  # half registered with their sha256 up front, half learnt at first read
            sha = content_sha256((path / "adapter_config.json").read_bytes(), (path / "adapter_model.safetensors").read_bytes())
        eng.register_adapter(f"t{i % 5}/ad{i:03d}@1", path, sha, tenant_id=f"t{i % 5}")
    before = [(id(t), t.data_ptr()) for t in _slot_tensors(eng)]
    weights = [1 / (k + 1) ** 1.1 for k in range(200)]
    picks = rng.choices(range(200), weights=weights, k=160)
    reqs = [req(f"z{n}", prompt=TEXTS[n % len(TEXTS)][:40], adapter_key=f"t{i % 5}/ad{i:03d}@1", tenant_id=f"t{i % 5}", max_new_tokens=3)
            for n, i in enumerate(picks)]  # fmt: skip
    results = {}
    pending = list(reqs)
    while pending or eng.has_unfinished():
        for _ in range(min(12, len(pending))):
            eng.add_request(pending.pop(0))
        for res in eng.step():
            results[res.request_id] = res
    assert [(id(t), t.data_ptr()) for t in _slot_tensors(eng)] == before

    distinct = sorted(set(picks))
    stats = eng.stats()
    events = eng.pop_load_events()
    loads = [e for e in events if e.skip_reason is None]
    assert all(e.error_code is None and e.load_us >= 0 for e in events)
    # a store read either goes on to a slot (one disk load, dest gpu) or, read ahead while every slot was
    # pinned, waits in L2 (dest host) for a later L2 -> L1 copy
    disk = [e for e in loads if e.tier == "disk"]
    assert stats["adapter_loads"]["disk"] == len(disk) == len(distinct) == len({e.sha256 for e in disk})
    assert stats["adapter_loads"]["host"] == sum(e.tier == "host" for e in loads) > 0
    placements = sum(e.dest == "gpu" for e in loads)
    assert placements == stats["adapter_loads"]["host"] + sum(e.dest == "gpu" for e in disk)
    assert stats["adapter_evictions"]["gpu"] == placements - stats["lora_slots_used"] > 0
    assert stats["lora_slots_used"] == 8 and stats["lora_slots_pinned"] == 0
    assert stats["adapter_load_failures"] == 0 and stats["adapter_evictions"]["host"] == 0

    ref = Engine(config(demo_set, max_loras=1, enable_prefix_caching=False, **NO_WARM))
    by_adapter = defaultdict(list)
    for r in reqs:
        by_adapter[r.adapter_key].append(r)
    for key, group in by_adapter.items():
        i = int(key.split("/ad")[1][:3])
        ref.load_adapter(key, many_adapters[i])
        want = ref.generate([r.__class__(**{**r.__dict__, "request_id": r.request_id + "/ref"}) for r in group])
        for r, w in zip(group, want):
            assert results[r.request_id].ok and results[r.request_id].output_ids == w.output_ids, (r.request_id, key)
        ref.unload_adapter(key)


@pytest.mark.parametrize(("host_cache_bytes", "phase3_tier"), [(1 << 30, "host"), (0, "disk")], ids=["L2 holds them", "no L2"])
def test_load_and_eviction_counts_by_tier(demo_set, many_adapters, host_cache_bytes, phase3_tier):
    """4 slots; adapters A..D, then E..H, then A..D again: 4 disk loads and no eviction, 4 disk loads and 4
    evictions, then 4 loads from L2 (or from disk again without L2) and 4 evictions."""
    eng = Engine(config(demo_set, max_loras=4, host_cache_bytes=host_cache_bytes, adapter_loads_per_s=1e6, **NO_WARM))
    for i in range(8):
        eng.register_adapter(f"k{i}", many_adapters[i])

    def phase(keys: list[str]) -> tuple[Counter, int]:
        ev0 = eng.stats()["adapter_evictions"]["gpu"]
        res = eng.generate([req(f"{k}-{n}", adapter_key=k, max_new_tokens=2) for n in range(2) for k in keys])
        assert all(r.ok for r in res)
        tiers = Counter(e.tier for e in eng.pop_load_events())
        return tiers, eng.stats()["adapter_evictions"]["gpu"] - ev0

    assert phase(["k0", "k1", "k2", "k3"]) == (Counter(disk=4), 0)
    assert phase(["k4", "k5", "k6", "k7"]) == (Counter(disk=4), 4)
    assert phase(["k0", "k1", "k2", "k3"]) == (Counter({phase3_tier: 4}), 4)


def test_same_content_under_two_names_is_read_and_placed_once(demo_set, tmp_path):
    """Two keys of identical files: one disk load, one slot, a "duplicate_content" skip for the second key,
    and equal outputs."""
    eng = Engine(config(demo_set, **NO_WARM))
    copy = shutil.copytree(demo_set["adapters"]["all-r16"], tmp_path / "copy")
    eng.register_adapter("acme/a@1", demo_set["adapters"]["all-r16"], tenant_id="acme")
    eng.register_adapter("globex/b@7", copy, tenant_id="globex")
    a = eng.generate([req("a", adapter_key="acme/a@1", tenant_id="acme")])[0]
    b = eng.generate([req("b", adapter_key="globex/b@7", tenant_id="globex")])[0]
    assert a.output_ids == b.output_ids
    events = eng.pop_load_events()
    assert [(e.key, e.tier, e.skip_reason) for e in events] == [("acme/a@1", "disk", None), ("globex/b@7", "gpu", "duplicate_content")]
    assert eng.stats()["lora_slots_used"] == 1 and eng.resident_adapters() == ["acme/a@1", "globex/b@7"]


def test_new_adapter_admission_is_rate_limited(demo_set, many_adapters):
    """At 1 store read per second (burst 1), four new adapters requested at once load one per second; requests
    on the base model or on a loaded adapter never wait for the bucket; all outputs are right in the end."""
    clock = FakeClock(1000.0)
    eng = Engine(config(demo_set, adapter_loads_per_s=1.0, adapter_load_burst=1, **NO_WARM), clock=clock)
    for i in range(4):
        eng.register_adapter(f"n{i}", many_adapters[i])
    reqs = [req(f"r{i}", adapter_key=f"n{i}", max_new_tokens=3) for i in range(4)]
    for r in reqs:
        eng.add_request(r)
    results = run_until_done_at(eng, clock, steps_per_second=20)
    disk = [e for e in eng.pop_load_events() if e.tier == "disk"]
    assert len(disk) == 4 and eng.stats()["adapter_loads_throttled"] > 0
    assert [round(t) for t in results["__load_times__"]] == [1000, 1001, 1002, 1003]
    ref = Engine(config(demo_set, max_loras=4, **NO_WARM))
    for i, r in enumerate(reqs):
        ref.load_adapter(f"n{i}", many_adapters[i])
        assert results[r.request_id].output_ids == alone(ref, r).output_ids
    # a base request and one for a resident adapter go through while the bucket is empty
    eng.register_adapter("n9", many_adapters[9])
    eng.add_request(req("cold", adapter_key="n9", max_new_tokens=2))
    eng.add_request(req("base", max_new_tokens=2))
    eng.add_request(req("warm", adapter_key="n3", max_new_tokens=2))
    done = {}
    for _ in range(4):
        done.update({r.request_id: r for r in eng.step()})
    assert set(done) == {"base", "warm"}


def run_until_done_at(eng: Engine, clock: FakeClock, steps_per_second: int) -> dict:
    """Step, advancing the fake clock; records when each disk load happened."""
    out: dict = {"__load_times__": []}
    loaded = 0
    for _ in range(2000):
        if not eng.has_unfinished():
            return out
        out.update({r.request_id: r for r in eng.step()})
        now_loaded = eng.stats()["adapter_loads"]["disk"]
        out["__load_times__"] += [clock.t] * (now_loaded - loaded)
        loaded = now_loaded
        clock.t += 1 / steps_per_second
    raise AssertionError("did not finish")


def _other_base(src, dst):
    """A copy of the adapter that records another base's fingerprint."""
    path = shutil.copytree(src, dst)
    w = path / "adapter_model.safetensors"
    save_file(load_file(str(w)), str(w), metadata={FINGERPRINT_KEY: "f" * 64})
    return path


def _corrupt(src, dst):
    path = shutil.copytree(src, dst)
    w = path / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    return path


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda d, tmp: _corrupt(d["adapters"]["qv-r4"], tmp / "bad"), "adapter_corrupt"),
        (lambda d, tmp: tmp / "missing", "adapter_missing"),
        (lambda d, tmp: ("sha", d["adapters"]["qv-r4"]), "adapter_changed"),
        (lambda d, tmp: _other_base(d["adapters"]["qv-r4"], tmp / "other"), "adapter_base_mismatch"),
    ],
    ids=["corrupt", "missing", "sha256 differs", "other base"],
)
def test_a_failed_load_fails_its_requests_or_runs_them_on_the_base(demo_set, tmp_path, make, code):
    """A lazy load that fails: requests without fallback fail with the load's code (and a message naming the
    adapter); those with allow_base_fallback run on the base model, flagged; the failure is a load event."""
    made = make(demo_set, tmp_path)
    eng = Engine(config(demo_set, **NO_WARM))
    if isinstance(made, tuple) and made[0] == "sha":
        eng.register_adapter("bad", made[1], sha256="0" * 64)
    else:
        eng.register_adapter("bad", made)
    strict = req("strict", adapter_key="bad", max_new_tokens=4)
    lenient = req("lenient", adapter_key="bad", max_new_tokens=4)
    lenient = lenient.__class__(**{**lenient.__dict__, "allow_base_fallback": True})
    res = {r.request_id: r for r in eng.generate([strict, lenient])}
    assert res["strict"].error is not None and res["strict"].error.code == code, res["strict"].error
    assert res["lenient"].ok and res["lenient"].base_fallback and res["lenient"].adapter_key is None
    assert res["lenient"].output_ids == alone(eng, req("b", max_new_tokens=4)).output_ids
    failures = [e for e in eng.pop_load_events() if e.error_code is not None]
    assert [e.error_code for e in failures] == [code] and eng.stats()["adapter_load_failures"] == 1
    again = eng.generate([req("again", adapter_key="bad", max_new_tokens=2)])[0]
    assert again.error.code == code  # sticks until registered again


def test_adapters_of_running_requests_stay_pinned(demo_set, many_adapters):
    """With 2 slots held by two long requests, a third adapter's request waits; the running ones' adapters are
    never evicted while they run, and all three outputs are right."""
    eng = Engine(config(demo_set, max_loras=2, **NO_WARM))
    for i in range(3):
        eng.register_adapter(f"p{i}", many_adapters[i])
    reqs = [req("p0", adapter_key="p0", max_new_tokens=20), req("p1", adapter_key="p1", max_new_tokens=12), req("p2", adapter_key="p2", max_new_tokens=4)]
    for r in reqs:
        eng.add_request(r)
    shas = {k: None for k in ("p0", "p1", "p2")}

    def check(e):
        running = {s.adapter_key for s in e.planner.running}
        resident = set(e.resident_adapters())
        assert running <= resident, (running, resident)
        if "p2" in running:
            shas["p2"] = True

    results = run_until_done(eng, on_step=check)
    assert shas["p2"] and results["p2"].timings.queue_us > 0
    ref = Engine(config(demo_set, max_loras=3, **NO_WARM))
    for i, r in enumerate(reqs):
        ref.load_adapter(f"p{i}", many_adapters[i])
        assert results[r.request_id].output_ids == alone(ref, r).output_ids


SLOT = 1_000_000


@pytest.mark.parametrize(
    ("candidates", "mem_weight", "victim"),
    [
        ([], 1.0, None),
        ([Candidate("hot", 1.0, 1.0, SLOT // 2, 0.0), Candidate("cold", 0.01, 1.0, SLOT // 2, 5.0)], 1.0, "cold"),
        ([Candidate("premium", 0.1, 4.0, SLOT // 2, 0.0), Candidate("standard", 0.1, 1.0, SLOT // 2, 5.0)], 1.0, "standard"),
        ([Candidate("big", 0.1, 1.0, SLOT, 0.0), Candidate("small", 0.1, 1.0, SLOT // 10, 5.0)], 1.0, "small"),
        ([Candidate("big", 0.1, 1.0, SLOT, 5.0), Candidate("small", 0.1, 1.0, SLOT // 10, 0.0)], 0.0, "small"),  # tie: LRU
        ([Candidate("old", 0.1, 1.0, SLOT, 1.0), Candidate("new", 0.1, 1.0, SLOT, 2.0)], 1.0, "old"),
        # the docstring's example: B is a premium, large, but ten times colder adapter
        ([Candidate("A", 0.5, 1.0, 300_000, 0.0), Candidate("B", 0.05, 4.0, 2_700_000, 5.0)], 1.0, "B"),
    ],
    ids=["none", "heat", "slo tier", "memory cost", "no memory weight: LRU", "LRU tie-break", "docstring example"],
)
def test_eviction_picks_the_lowest_keep_score(candidates, mem_weight, victim):
    """Heat, SLO tier and memory cost each move an adapter's keep score; ties go to the least recently used."""
    slot = 2_700_000 if victim in ("B",) else SLOT
    assert choose_victim(candidates, mem_weight=mem_weight, slot_bytes=slot) == victim


def test_heat_is_requests_per_second_over_five_minutes():
    h = Heat()
    for _ in range(30):
        h.hit(100.0)
    assert h.rate(100.0) == pytest.approx(30 / HEAT_WINDOW_S)
    assert h.rate(100.0 + HEAT_WINDOW_S) == pytest.approx(30 / HEAT_WINDOW_S / math.e)
    c = Candidate("x", h.rate(100.0), 1.0, 0, 0.0)
    assert keep_score(c, mem_weight=1.0, slot_bytes=1) == pytest.approx(31 / HEAT_WINDOW_S)


def test_token_bucket():
    clock = FakeClock()
    b = TokenBucket(2.0, 3, clock)
    assert [b.try_take() for _ in range(4)] == [True, True, True, False]
    assert b.wait_s() == pytest.approx(0.5)
    clock.t = 0.5
    assert b.try_take() and not b.try_take()
    clock.t = 100.0
    assert [b.try_take() for _ in range(4)] == [True, True, True, False]  # refills to the burst, no further
    b.take()
    assert b.wait_s() == pytest.approx(1.0)  # an eager take runs the bucket into debt


DAY, HOUR = 86400, 3600


def test_predictor_blends_recent_traffic_with_the_hour_of_day():
    """The warm_pool docstring's example: 20 requests every day at 09:xx; at 08:30 on day 8 the forecast is
    0.6 * EWMA + 0.4 * 20 (about 8); at 12:30 it is about 0; with no full day seen, only the EWMA."""
    p = TrafficPredictor(alpha=0.3, recent_weight=0.6)
    for day in range(7):
        for k in range(20):
            p.observe("x", day * DAY + 9 * HOUR + 60 * k)
    at = 7 * DAY + 8 * HOUR + 1800
    ewma = 20.0  # the first hour seeds it; each later 09:00 hour adds 0.3 * 20 after 23 idle hours of decay
    for _ in range(6):
        ewma = 0.3 * 20 + 0.7 * ewma * 0.7**23
    recent = 0.7 * ewma * 0.7**22  # 22 idle hours since, then the hour in progress (no requests) folded in
    assert p.forecast("x", at) == pytest.approx(0.6 * recent + 0.4 * 20)
    assert 8.0 < p.forecast("x", at) < 8.01
    assert p.forecast("x", 7 * DAY + 12 * HOUR + 1800) < 0.01
    assert p.ranked(at, 1.0) == [("x", pytest.approx(p.forecast("x", at)))]
    q = TrafficPredictor(alpha=0.3, recent_weight=0.6)
    for k in range(10):
        q.observe("y", 5 * HOUR + k)
    assert q.forecast("y", 5 * HOUR + 100) == 10  # the hour in progress, as if complete
    assert q.forecast("y", 6 * HOUR + 100) == pytest.approx(0.7 * 10)  # folded into the EWMA, now idle
    assert q.forecast("nobody", 0) == 0.0


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
    eng = Engine(config(demo_set, max_loras=8, max_batch_size=2, decode_steps=2, adapter_loads_per_s=1e9, adapter_load_burst=10**6, **NO_WARM))
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
    bad = _corrupt(demo_set["adapters"]["qv-r4"], tmp_path / "bad")
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
