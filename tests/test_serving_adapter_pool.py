"""The tiered adapter pool: churn through few slots, exact load counts by tier, dedupe, admission rate limit,
failed loads (fail or fall back), pinning, the eviction score, and the warm pool's predictor. What comes ahead of a
request (the warm pool's loads, prefetch, read-ahead, reader processes, the host arena): test_serving_adapter_reads.py."""

from __future__ import annotations

import contextlib
import math
import random
import shutil
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
from engine.engine import Engine
from engine.store import content_sha256
from engine.warm_pool import TrafficPredictor
from tests.test_serving_helpers import NO_WARM, TEXTS, FakeClock, _slot_tensors, alone, config, corrupt_copy, many_adapters, req, run_until_done  # noqa: F401 (a fixture)



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


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda d, tmp: corrupt_copy(d["adapters"]["qv-r4"], tmp / "bad"), "adapter_corrupt"),
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


def _other_weights(entry, src, tmp):
    shutil.copy(src.parent / "qv-r16" / "adapter_model.safetensors", entry / "adapter_model.safetensors")


def _weights_gone(entry, src, tmp):
    (entry / "adapter_model.safetensors").unlink()


def _entry_gone(entry, src, tmp):
    shutil.rmtree(entry)


def _weights_a_link_out(entry, src, tmp):
    (entry / "adapter_model.safetensors").rename(tmp / "elsewhere.safetensors")
    (entry / "adapter_model.safetensors").symlink_to(tmp / "elsewhere.safetensors")


@pytest.mark.parametrize(
    ("damage", "code"),
    [(_other_weights, "adapter_changed"), (_weights_gone, "adapter_missing"), (_entry_gone, "adapter_missing"),
     (_weights_a_link_out, "adapter_unsafe")],
    ids=["changed", "file gone", "folder gone", "a link out"],
)  # fmt: skip
def test_an_adapter_whose_files_changed_loads_once_they_are_put_back(demo_set, tmp_path, damage, code):
    """Registered files that no longer load (other content under the sha256, a file or the folder gone, a link out of
    the folder) fail its requests with their code and never load, read once while they stay as they are; once the
    registered content is back under the path (as `lorabatch adapters add` of the folder puts it back), the next request
    reads it again and runs on it. Only adapter_changed was read again: a gone or linked file stuck, and a running
    worker failed the adapter's jobs until it was restarted, however the store entry was repaired."""
    src = demo_set["adapters"]["qv-r4"]
    path = shutil.copytree(src, tmp_path / "entry")
    sha = content_sha256((src / "adapter_config.json").read_bytes(), (src / "adapter_model.safetensors").read_bytes())
    damage(path, src, tmp_path)
    eng = Engine(config(demo_set, **NO_WARM))
    eng.register_adapter("a", path, sha256=sha)
    for i in range(2):
        failed = eng.generate([req(f"changed-{i}", adapter_key="a", max_new_tokens=2)])[0]
        assert failed.error is not None and failed.error.code == code, failed.error
    assert eng.stats()["adapter_load_failures"] == 1, "files left as they were are not read again"
    if code != "adapter_changed":
        assert "its next request reads them again" in failed.error.message, failed.error.message
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(src, path)
    back = eng.generate([req("back", adapter_key="a", max_new_tokens=4)])[0]
    ref = Engine(config(demo_set, **NO_WARM))
    ref.register_adapter("a", src, sha256=sha)
    assert back.ok and back.output_ids == ref.generate([req("back", adapter_key="a", max_new_tokens=4)])[0].output_ids


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


def _tiered_engine(demo_set, many_adapters, slots: int, count: int, clock: FakeClock) -> tuple[Engine, list[str]]:
    """An engine of `slots` L1 slots on `clock` with `count` adapters k0.. registered, tiers premium, standard, batch in turn."""
    eng = Engine(config(demo_set, max_loras=slots, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000, **NO_WARM),
                 clock=clock)  # fmt: skip
    keys = [f"k{i}" for i in range(count)]
    for i, key in enumerate(keys):
        eng.register_adapter(key, many_adapters[i], slo_tier=("premium", "standard", "batch")[i % 3])
    return eng, keys


def _placements(demo_set, many_adapters, *, walk: bool, hot: str | None = None) -> list[tuple[str, ...]]:
    """12 adapters of mixed tiers, heat and sizes through 6 slots: 6 placed, then 6 more, in one placement walk or one
    at a time; `hot` gets 50 requests after the first of the 6. Which adapters are resident after each of the 6."""
    clock = FakeClock(100.0)
    eng, keys = _tiered_engine(demo_set, many_adapters, 6, 12, clock)
    pool = eng.adapters
    for i, key in enumerate(keys[:6]):
        clock.t += 1.0
        for _ in range(i % 4):
            pool.note_request(key)
        assert isinstance(pool.prefetch(key, ()), int)
    clock.t += 1.0
    seen = []
    with pool.placing() if walk else contextlib.nullcontext():
        for j, key in enumerate(keys[6:]):
            assert isinstance(pool.prefetch(key, ()), int)
            seen.append(tuple(sorted(eng.resident_adapters())))
            if j == 0 and hot is not None:
                for _ in range(50):
                    pool.note_request(hot)
    return seen


def test_a_placement_walk_evicts_as_single_placements_do(demo_set, many_adapters):
    """A walk of placements ranks the eviction candidates once (L1Placement.placing): it evicts the same adapters in
    the same order as placements one at a time, its own placements among the candidates, and requests arriving inside
    it (heat) count as they would outside: the adapter the second placement evicted stays when it turns hot."""
    alone = _placements(demo_set, many_adapters, walk=False)
    assert _placements(demo_set, many_adapters, walk=True) == alone
    assert len(set(alone)) == 6  # each placement evicted something
    (second,) = set(alone[0]) - set(alone[1])
    alone_hot = _placements(demo_set, many_adapters, walk=False, hot=second)
    assert second in alone_hot[1]
    assert _placements(demo_set, many_adapters, walk=True, hot=second) == alone_hot


def test_a_walk_that_raises_leaves_no_ranking_behind(demo_set, many_adapters):
    """A placement walk ended by an exception (a failed admission, say) drops its ranking: the next placement outside
    any walk ranks afresh at the clock's time and evicts as usual; walks nest, the inner one using the outer's."""
    clock = FakeClock(10.0)
    eng = Engine(config(demo_set, max_loras=2, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000, **NO_WARM),
                 clock=clock)  # fmt: skip
    pool = eng.adapters
    for i in range(4):
        eng.register_adapter(f"k{i}", many_adapters[i])
    assert isinstance(pool.prefetch("k0", ()), int) and isinstance(pool.prefetch("k1", ()), int)
    with pytest.raises(RuntimeError, match="admission failed"), pool.placing():
        with pool.placing():  # nested: the outer walk's ranking
            assert isinstance(pool.prefetch("k2", ()), int)  # evicts one of k0, k1
            assert pool._ranking is not None and pool._ranked_at == 10.0 and pool._walking
        assert pool._walking
        raise RuntimeError("admission failed")
    assert pool._ranking is None and not pool._walking
    clock.t = 20.0
    assert isinstance(pool.prefetch("k3", ()), int)
    assert len(eng.resident_adapters()) == 2 and "k3" in eng.resident_adapters()
    assert pool._ranked_at == 20.0


def test_the_kept_ranking_is_a_fresh_ranking_at_its_time(demo_set, many_adapters):
    """The ranking kept between placements (engine.adapter_residency "Ranking") follows every change one entry at a
    time: after random requests (heat), placements and evictions, admissions and releases (last use), keys linked to
    and dropped from a resident content, adapters unloaded and the L1 offloaded, it equals a ranking made afresh at its
    time, entry for entry; it is renewed once RANK_TTL_S old, and not inside a walk."""
    import random

    from engine.adapter_residency import RANK_TTL_S

    rng = random.Random(7)
    clock = FakeClock(100.0)
    eng, keys = _tiered_engine(demo_set, many_adapters, 4, 10, clock)
    pool = eng.adapters
    pinned: list[str] = []
    aliases = 0
    checked = 0
    for _ in range(400):
        clock.t += rng.choice((0.0, 0.01, 0.2))
        op = rng.random()
        key = rng.choice(keys)
        if not pool.has(key):
            continue
        if op < 0.3:
            pool.note_request(key)
        elif op < 0.55:
            pool.prefetch(key, ())
        elif op < 0.7:
            got = pool.acquire(key)
            if isinstance(got, tuple):
                pinned.append(pool.sha_of(key))
        elif op < 0.85 and pinned:
            pool.release(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.9 and pool.sha_of(key) is not None:
            aliases += 1
            alias = f"{key}-alias{aliases}"
            eng.register_adapter(alias, many_adapters[keys.index(key)], pool.sha_of(key), slo_tier="batch")
            keys.append(alias)
        elif op < 0.95 and "-alias" in key:
            eng.unload_adapter(key)
            keys.remove(key)
        elif op < 0.97:
            pool.offload()
        if pool._ranking is not None:
            checked += 1
            assert pool._ranking == pool._rank(pool._ranked_at)
            assert pool._rank_of == {entry[1]: entry for entry in pool._ranking}
    assert checked > 200 and aliases > 3
    pool.note_request(keys[0])
    assert pool._ranking is not None
    ranked_at = pool._ranked_at
    clock.t = ranked_at + RANK_TTL_S + 0.5
    with pool.placing():  # begun with a ranking too old: made afresh at its first eviction
        assert pool._ranking is None
        for key in keys[:8]:
            pool.prefetch(key, ())
        assert pool._ranked_at == (walk_start := clock.t)
        clock.t += 2 * RANK_TTL_S  # inside a walk: kept
        for key in keys[:8]:
            pool.prefetch(key, ())
        assert pool._ranked_at == walk_start
    pool.prefetch(keys[8], ())  # outside: too old, made afresh
    assert pool._ranked_at == clock.t


def test_the_kept_ranking_follows_unloads_reloads_and_the_warm_pool(demo_set, many_adapters):
    """As the test above, with the warm pool placing adapters of its own and keys unloaded whole (the last key of a
    resident content among them: its slot freed and its entry gone) and registered or loaded again, walks of placements
    among the rest and clock jumps past RANK_TTL_S: the kept ranking is a fresh ranking at its time after every step."""
    import random

    from engine.adapter_residency import RANK_TTL_S

    rng = random.Random(11)
    clock = FakeClock(100.0)
    eng = Engine(config(demo_set, max_loras=4, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000,
                        warm_pool_slots=2, warm_pool_host_bytes=1 << 30, warm_pool_interval_s=0.001, warm_pool_min_per_hour=0.001),
                 clock=clock)  # fmt: skip
    pool = eng.adapters
    paths = {f"k{i}": many_adapters[i] for i in range(10)}
    for i, (key, path) in enumerate(paths.items()):
        eng.register_adapter(key, path, slo_tier=("premium", "standard", "batch")[i % 3])
    pinned: list[str] = []
    checked = resident_unloads = 0
    for _ in range(600):
        clock.t += rng.choice((0.0, 0.01, 0.2, RANK_TTL_S + 0.5))
        op, key = rng.random(), rng.choice(list(paths))
        if op < 0.25:
            pool.note_request(key)
        elif op < 0.45:
            pool.prefetch(key, ())
        elif op < 0.55:
            if isinstance(pool.acquire(key), tuple):
                pinned.append(pool.sha_of(key))
        elif op < 0.65 and pinned:
            pool.release(pinned.pop(rng.randrange(len(pinned))))
        elif op < 0.75 and pool.sha_of(key) not in pinned:
            sha = pool.sha_of(key)
            content = pool._contents.get(sha) if sha else None
            resident_unloads += content is not None and content.slot is not None and len(content.keys) == 1
            pool.unload(key)
            if rng.random() < 0.5:
                eng.load_adapter(key, paths[key])
            else:
                eng.register_adapter(key, paths[key], sha)
        elif op < 0.85:
            pool.warm()
        elif op < 0.88:
            pool.offload()
        elif op < 0.95:
            with pool.placing():
                for other in rng.sample(list(paths), 4):
                    pool.prefetch(other, ())
        if pool._ranking is not None:
            checked += 1
            assert pool._ranking == pool._rank(pool._ranked_at)
            assert pool._rank_of == {entry[1]: entry for entry in pool._ranking}
    assert checked > 100 and resident_unloads > 3 and pool.counters["warm_prefetches"] > 0, (checked, resident_unloads, pool.counters)


def test_the_walk_ranking_scores_as_keep_score(demo_set, many_adapters):
    """The placement walk's inline scores (L1Placement._rank_entry) are engine.adapter_policy's keep_score of the same
    candidate, for adapters of every tier, with and without heat, and one content under two keys of two tiers."""
    clock = FakeClock(50.0)
    eng = Engine(config(demo_set, max_loras=8, host_cache_bytes=1 << 30, adapter_loads_per_s=1e6, adapter_load_burst=1000, **NO_WARM),
                 clock=clock)  # fmt: skip
    pool = eng.adapters
    for i in range(6):
        eng.register_adapter(f"k{i}", many_adapters[i], slo_tier=("premium", "standard", "batch")[i % 3])
        for _ in range(i):
            pool.note_request(f"k{i}")
        clock.t += 7.0
        assert isinstance(pool.prefetch(f"k{i}", ()), int)
    eng.register_adapter("k0-again", many_adapters[0], pool.sha_of("k0"), slo_tier="batch")
    pool.note_request("k0-again")
    clock.t += 30.0
    weights = eng.config.adapter_slo_weights
    ranked = pool._rank(clock.t)
    assert len(ranked) == 6
    for (score, last_used, slot), sha in ranked:
        content = pool._contents[sha]
        recs = [pool._records[k] for k in content.keys]
        candidate = Candidate(sha, sum(r.heat.rate(clock.t) for r in recs), max(weights[r.slo_tier] for r in recs), content.meta.nbytes,
                              content.last_used)  # fmt: skip
        assert score == keep_score(candidate, mem_weight=eng.config.adapter_mem_weight, slot_bytes=pool._slot_bytes)
        assert (last_used, slot) == (content.last_used, content.slot)
    assert [sha for _, sha in ranked] == [sha for _, sha in sorted(ranked)]


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
