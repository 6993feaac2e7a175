"""Admission hold-back (engine.admission) in the engine, with read-ahead threads and store reads released one at a time:
a batch whose reads land one by one is admitted in few prompt steps, nothing is held while nothing runs, a batch
admitted in parts is replaced in one prompt step, and a failed read fails its request alone."""

from __future__ import annotations

import threading
import time

import pytest

from engine.demo_model import write_demo_adapter
from engine.engine import Engine
from tests.test_admission_hold import BOUND_MS, FakeClock
from tests.test_serving_helpers import config, req

NO_WARM = dict(warm_pool_slots=0, warm_pool_host_bytes=0)


@pytest.fixture(scope="module")
def adapters(demo_set, tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("hold")
    paths = []
    for i in range(6):
        write_demo_adapter(root / f"h{i}", demo_set["model"], rank=4, target_modules=("q_proj", "v_proj"), alpha=8.0, seed=7000 + i)
        paths.append(root / f"h{i}")
    return paths


class Gates:
    """Store reads on the read-ahead threads wait until the test opens their key's gate (or all of them)."""

    def __init__(self) -> None:
        self._open: set[str] = set()
        self._all = False
        self._cv = threading.Condition()

    def open(self, key: str | None = None) -> None:
        with self._cv:
            if key is None:
                self._all = True
            else:
                self._open.add(key)
            self._cv.notify_all()

    def wait(self, key: str) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._all or key in self._open, timeout=60)


@pytest.fixture
def gates(monkeypatch):
    import engine.adapter_records as records

    gates = Gates()
    real = records.read_adapter

    def gated(rec, *args, **kwargs):
        gates.wait(rec.key)
        return real(rec, *args, **kwargs)

    monkeypatch.setattr(records, "read_adapter", gated)
    yield gates
    gates.open()  # no read thread left waiting after the test


def _land(eng: Engine, gates: Gates, key: str) -> None:
    """Open `key`'s gate and wait for its read to finish on its thread (a synchronisation, not a timing)."""
    gates.open(key)
    for _ in range(2000):
        if eng.adapters._ahead.done(key):
            return
        time.sleep(0.005)
    raise AssertionError(f"the read of {key} did not finish")


def _prompt_steps(records, ids: set[str]) -> set[int]:
    return {r.step_id for r in records for s in r.shares if s.request_id in ids and s.tokens > 1}


@pytest.mark.parametrize(("hold_ms", "prompt_steps"), [(0.0, 6), (BOUND_MS, 2)])
def test_engine_admits_a_batch_whose_reads_land_one_by_one_in_few_prompt_steps(demo_set, adapters, gates, hold_ms, prompt_steps):
    """An engine with read-ahead threads, one base request running, six requests for six adapters whose reads land one
    a step: held back, they take 2 prompt steps (5 = 3/4 of 6 places, then the last), not 6; every request's tokens
    are the same either way."""
    clock = FakeClock()
    eng = Engine(config(demo_set, max_batch_size=8, max_loras=8, adapter_read_threads=8, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, admission_hold_ms=hold_ms, **NO_WARM), clock=clock)  # fmt: skip
    for i, path in enumerate(adapters):
        eng.register_adapter(f"h{i}", path)
    eng.add_request(req("base", max_new_tokens=30))
    results = {r.request_id: r for r in eng.step()}
    ids = {f"q{i}" for i in range(6)}
    for i in range(6):
        eng.add_request(req(f"q{i}", adapter_key=f"h{i}", max_new_tokens=4))
    for i in range(6):
        clock.ms += 1
        results.update((r.request_id, r) for r in eng.step())
        _land(eng, gates, f"h{i}")
    while eng.has_unfinished():
        clock.ms += 1
        results.update((r.request_id, r) for r in eng.step())
    assert len(_prompt_steps(eng.pop_step_records(), ids)) == prompt_steps
    assert all(r.ok for r in results.values()) and set(results) == ids | {"base"}, results
    assert eng.stats()["admission_holds"] == (4 if hold_ms else 0)


def test_engine_with_nothing_running_admits_the_first_read_at_once(demo_set, adapters, gates):
    """Nothing runs: the first request whose read lands is admitted at the next step, alone, while five others' reads are
    still under way (no hold: the GPU would idle)."""
    clock = FakeClock()
    eng = Engine(config(demo_set, max_batch_size=8, max_loras=8, adapter_read_threads=8, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, **NO_WARM), clock=clock)  # fmt: skip
    for i, path in enumerate(adapters):
        eng.register_adapter(f"h{i}", path)
    for i in range(6):
        eng.add_request(req(f"q{i}", adapter_key=f"h{i}", max_new_tokens=4))
    eng.step()  # starts the reads
    _land(eng, gates, "h0")
    eng.step()
    assert _prompt_steps(eng.pop_step_records(), {"q0"}) and eng.stats()["admission_holds"] == 0
    assert [s.request_id for s in eng.planner.running] == ["q0"]
    gates.open()
    while eng.has_unfinished():
        clock.ms += 1
        eng.step()
        time.sleep(eng.idle_wait_s())


def test_engine_replaces_a_batch_admitted_in_parts_in_one_prompt_step(demo_set):
    """The engine: requests of 6 tokens admitted in parts of 1, 2 and 1 finish in parts; the 4 waiting behind them
    are admitted in one prompt step once the last part is done, and every request gets its 6 tokens."""
    eng = Engine(config(demo_set, max_batch_size=4, max_loras=2, **NO_WARM), clock=FakeClock())  # no bound reached
    results = {}
    n = 0
    for size in (1, 2, 1):
        for _ in range(size):
            eng.add_request(req(f"p{n}", max_new_tokens=6))
            n += 1
        results.update((r.request_id, r) for r in eng.step())
    later = {f"later{i}" for i in range(4)}
    for rid in sorted(later):
        eng.add_request(req(rid, max_new_tokens=6))
    while eng.has_unfinished():
        results.update((r.request_id, r) for r in eng.step())
    assert len(_prompt_steps(eng.pop_step_records(), later)) == 1
    assert set(results) == later | {f"p{i}" for i in range(4)}
    assert all(r.ok and len(r.output_ids) == 6 for r in results.values()), results
    assert eng.stats()["admission_holds"] == 2


def test_engine_fails_a_request_whose_read_fails_and_runs_the_rest(demo_set, adapters, gates, tmp_path):
    """A corrupt adapter among reads landing one by one while a request runs and admissions are held: its request fails
    with adapter_corrupt and the others finish."""
    bad = tmp_path / "bad"
    write_demo_adapter(bad, demo_set["model"], rank=4, target_modules=("q_proj", "v_proj"), alpha=8.0, seed=7100)
    w = bad / "adapter_model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    clock = FakeClock()
    eng = Engine(config(demo_set, max_batch_size=8, max_loras=8, adapter_read_threads=8, adapter_loads_per_s=1e9,
                        adapter_load_burst=10**6, **NO_WARM), clock=clock)  # fmt: skip
    keys = ["h0", "bad", "h1", "h2", "h3"]
    for i, path in enumerate(adapters[:4]):
        eng.register_adapter(f"h{i}", path)
    eng.register_adapter("bad", bad)
    eng.add_request(req("base", max_new_tokens=30))
    results = {r.request_id: r for r in eng.step()}
    for k in keys:
        eng.add_request(req(f"q-{k}", adapter_key=k, max_new_tokens=4))
    for k in keys:
        clock.ms += 1
        results.update((r.request_id, r) for r in eng.step())
        _land(eng, gates, k)
    for _ in range(200):
        if not eng.has_unfinished():
            break
        clock.ms += 11  # past the bound within a few steps, whatever is still held
        results.update((r.request_id, r) for r in eng.step())
    assert not eng.has_unfinished()
    assert results["q-bad"].error is not None and results["q-bad"].error.code == "adapter_corrupt"
    assert all(results[f"q-{k}"].ok for k in keys if k != "bad") and results["base"].ok
