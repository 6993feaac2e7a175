"""Request isolation in the engine: identity is (tenant, request_id), and one request's failure (admission, forward,
logits, sampling, detokenizing) fails that request alone while its batchmates get exactly their own tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest

import engine.engine as engine_module
import engine.isolation as isolation
from engine.api import ADAPTER_ERROR_CODES, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.sequence import Sequence
from tests.test_serving_helpers import TEXTS, alone, config, demo_engine, patch_forward, req

ENGINE_DIR = Path(engine_module.__file__).parent


@pytest.fixture(scope="module")
def eng(demo_set):
    return demo_engine(demo_set, enable_prefix_caching=False)


def _batch() -> list:
    """Four requests of mixed adapters, prompts, greedy and sampled; "bad" is the one the tests break."""
    return [
        req("ok-0", prompt=TEXTS[1], adapter_key="all-r16", max_new_tokens=6),
        req("bad", prompt=TEXTS[2], adapter_key="qv-r4", max_new_tokens=6, temperature=0.8, seed=3),
        req("ok-1", prompt=TEXTS[3], max_new_tokens=6, temperature=1.0, seed=7),
        req("ok-2", prompt=TEXTS[4], adapter_key="mlp-r64", max_new_tokens=6),
    ]


def _seq_ids(engine: Engine, request_id: str) -> set[int]:
    return {s.seq_id for s in engine._unfinished.values() if s.request_id == request_id}


def _rows_of(items, seq_ids: set[int]) -> list[int]:
    """Logit rows of the items of `seq_ids`."""
    return [r for r, it in enumerate([it for it in items if it.logits]) if it.seq_id in seq_ids]


def _assert_isolated(engine: Engine, results, reqs, bad_code: str, reference: Engine) -> None:
    for r, res in zip(reqs, results):
        if r.request_id == "bad":
            assert res.error is not None and res.error.code == bad_code, res.error
        else:
            assert res.ok, (r.request_id, res.error)
            assert res.output_ids == alone(reference, r).output_ids, r.request_id
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == stats["kv_pool_used_blocks"] == 0 and stats["lora_slots_pinned"] == 0


# ---- identity


@pytest.mark.parametrize("front", ["generate", "async"])
async def test_two_tenants_with_one_request_id_each_get_their_own_output(eng, front):
    """Identity is (tenant, request_id): tenants a and b both send "r1" in one batch, and each gets its own prompt's
    tokens, routed back by tenant."""
    reqs = [req("r1", prompt=TEXTS[0], tenant_id="a", max_new_tokens=8), req("r1", prompt=TEXTS[3], tenant_id="b", max_new_tokens=8),
            req("r1", prompt=TEXTS[5], max_new_tokens=5)]  # fmt: skip
    if front == "generate":
        results = eng.generate(reqs)
    else:
        async with AsyncEngine(eng) as ae:
            results = await asyncio.gather(*(ae.generate(r) for r in reqs))
    for r, res in zip(reqs, results):
        assert res.ok and (res.tenant_id, res.request_id) == (r.tenant_id, r.request_id), res.error
        assert res.output_ids == alone(eng, r).output_ids, r.tenant_id
    assert not eng.has_unfinished()


@pytest.mark.parametrize("front", ["generate", "async"])
async def test_the_same_tenant_and_request_id_twice_refuses_the_second_only(eng, front):
    """A second request of one (tenant, request_id) in flight fails with duplicate_request_id; the first runs, and the
    same id of another tenant runs too."""
    # The copy is sent right behind the first, not 10 ms after it: 8 tokens finished within that at one torch thread, and
    # the copy then ran as a new request. Queued or running, the first is in flight (the one-batch front shows the same).
    reqs = [req("dup", tenant_id="a", max_new_tokens=32), req("dup", tenant_id="a", max_new_tokens=2), req("dup", tenant_id="b", max_new_tokens=3)]
    if front == "generate":
        results = eng.generate(reqs)
    else:
        async with AsyncEngine(eng) as ae:
            first = asyncio.create_task(ae.generate(reqs[0]))
            await asyncio.sleep(0)  # the first is submitted
            results = [None, *await asyncio.gather(ae.generate(reqs[1]), ae.generate(reqs[2]))]
            results[0] = await first
    assert [res.error.code if res.error else None for res in results] == [None, "duplicate_request_id", None]
    assert results[1].tenant_id == "a" and len(results[0].output_ids) == 32 and len(results[2].output_ids) == 3


async def test_abort_takes_the_tenant(eng):
    """abort(request_id, tenant) stops that tenant's request only; the other tenant's request of the same id runs on."""
    async with AsyncEngine(eng) as ae:
        a = asyncio.create_task(ae.generate(req("ab", tenant_id="a", max_new_tokens=32)))
        b = asyncio.create_task(ae.generate(req("ab", tenant_id="b", max_new_tokens=6)))
        while not (await ae.stats())["running"]:
            await asyncio.sleep(0.002)
        assert await ae.abort("ab") is None  # tenant "" has no such request
        aborted = await ae.abort("ab", tenant_id="a")
        assert aborted is not None and aborted.error.code == "aborted" and aborted.tenant_id == "a"
        ra, rb = await a, await b
    assert ra.error.code == "aborted" and rb.ok and len(rb.output_ids) == 6


# ---- numerics


@pytest.mark.parametrize(
    "sampling",
    [
        dict(temperature=1e-300, seed=1),
        dict(temperature=1e-6, seed=1),
        dict(temperature=5.0, seed=1),
        dict(temperature=1.0, top_p=1e-300, seed=1),
        dict(temperature=1.0, top_k=10**12, seed=1),
        dict(temperature=0.7, top_k=1, top_p=1e-300, seed=0),
        dict(temperature=1.0, seed=0),
        dict(temperature=1.0, seed=2**63 - 1),
        dict(temperature=1.0, seed=-1),  # outside the job contract: folded into manual_seed's range
        dict(temperature=1.0, seed=2**200),
        dict(temperature=5.0, top_p=1.0, top_k=0, seed=2**63 - 1, logprobs=20),
    ],
    ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()),
)
def test_extreme_sampling_params_finish(eng, sampling):
    """Every value the job contract accepts (and other ints for the seed) samples to max_new_tokens without raising;
    a temperature at or below TEMPERATURE_FLOOR is greedy."""
    r = req("x", tenant_id="t", max_new_tokens=6, **sampling)
    res = eng.generate([r])[0]
    assert res.ok, res.error
    assert len(res.output_ids) == 6 and all(0 <= t < eng.runner.config.vocab_size for t in res.output_ids)
    if sampling["temperature"] < 1e-5:
        greedy = eng.generate([dataclasses.replace(r, sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))])[0]
        assert res.output_ids == greedy.output_ids


@pytest.mark.parametrize(
    ("poison", "greedy"),
    [("nan", True), ("nan", False), ("+inf", True), ("+inf", False), ("all -inf", False), ("one nan", False)],
)
def test_unusable_logits_fail_their_request_alone(eng, monkeypatch, poison, greedy):
    """A row of NaN/+inf logits (or nothing finite) fails its request with sampling_failed; nothing non-finite reaches
    torch.multinomial, and the other rows get exactly their own tokens."""
    reqs = _batch()
    if greedy:
        reqs[1] = dataclasses.replace(reqs[1], sampling=SamplingParams(max_new_tokens=6, ignore_eos=True))
    for r in reqs:
        eng.add_request(r)
    bad = _seq_ids(eng, "bad")

    def edit(items, logits):
        for row in _rows_of(items, bad):
            if poison == "nan":
                logits[row] = float("nan")
            elif poison == "+inf":
                logits[row, 5] = float("inf")
            elif poison == "all -inf":
                logits[row] = float("-inf")
            else:
                logits[row, 7] = float("nan")

    patch_forward(monkeypatch, eng, edit)
    out = {}
    while eng.has_unfinished():
        out.update({res.request_id: res for res in eng.step()})
    monkeypatch.undo()
    _assert_isolated(eng, [out[r.request_id] for r in reqs], reqs, "sampling_failed", eng)
    assert "NaN or +inf" in str(out["bad"].error)  # found as unusable, not by torch.multinomial raising


def test_partly_masked_logits_still_sample(eng, monkeypatch):
    """-inf logits are masked tokens, not a fault: a row with some -inf samples among the finite ones."""
    r = req("masked", max_new_tokens=4, temperature=1.0, seed=2, logprobs=3)
    eng.add_request(r)
    ids = _seq_ids(eng, "masked")

    def edit(items, logits):
        for row in _rows_of(items, ids):
            logits[row, 10:] = float("-inf")

    patch_forward(monkeypatch, eng, edit)
    out = {}
    while eng.has_unfinished():
        out.update({res.request_id: res for res in eng.step()})
    res = out["masked"]
    assert res.ok and all(t < 10 for t in res.output_ids), (res.error, res.output_ids)
    lps = [e["logprob"] for entry in res.logprobs["content"] for e in [entry, *entry["top_logprobs"]]]
    assert all(-10_000 < lp <= 0 for lp in lps), lps  # JSON-safe: no -inf


# ---- failures of one request


def _raise_with_bad(bad: set[int]):
    def edit(items, logits):
        if any(it.seq_id in bad for it in items):
            raise RuntimeError("simulated fault of one request's rows")

    return edit


@pytest.mark.parametrize("where", ["forward", "sampling", "detokenizing"])
def test_a_failure_of_one_request_fails_it_alone(eng, monkeypatch, where):
    """A forward that raises whenever "bad" is in the batch, a sampler that raises on its row, or detokenizing that
    raises on its token: "bad" fails with forward_failed / sampling_failed / decode_failed, the others succeed with
    exactly their own tokens, and no KV block or adapter pin is left behind."""
    reqs = _batch()
    for r in reqs:
        eng.add_request(r)
    bad = _seq_ids(eng, "bad")
    code = {"forward": "forward_failed", "sampling": "sampling_failed", "detokenizing": "decode_failed"}[where]
    if where == "forward":
        patch_forward(monkeypatch, eng, _raise_with_bad(bad))
    elif where == "sampling":
        real = isolation.sample_on_device

        def sample(logits, params, generators):
            if any(p.temperature == 0.8 for p in params):  # only "bad" samples at 0.8
                raise RuntimeError("simulated sampler fault")
            return real(logits, params, generators)

        monkeypatch.setattr(isolation, "sample_on_device", sample)
    else:
        real_append = Sequence.append_token

        def append(self, token_id, eos_ids):
            if self.request_id == "bad":
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "simulated")
            return real_append(self, token_id, eos_ids)

        monkeypatch.setattr(Sequence, "append_token", append)
    out = {}
    while eng.has_unfinished():
        out.update({res.request_id: res for res in eng.step()})
    monkeypatch.undo()
    _assert_isolated(eng, [out[r.request_id] for r in reqs], reqs, code, eng)
    assert not out["bad"].error.retriable


@pytest.mark.parametrize(
    ("fault", "codes"),
    [
        ("always", ["engine_failed"] * 4),  # no subset runs: the engine, not a request
        ("once", [None] * 4),  # a transient fault: the halves run, everyone succeeds
    ],
)
def test_a_forward_that_fails_for_everyone_fails_all_retriable(eng, monkeypatch, fault, codes):
    """When every request fails alone too, all fail with engine_failed (retriable); a fault that does not recur when
    the halves run fails nobody."""
    calls = {"n": 0}

    def edit(items, logits):
        calls["n"] += 1
        if fault == "always" or calls["n"] == 2:
            raise RuntimeError("simulated device fault")

    reqs = _batch()
    patch_forward(monkeypatch, eng, edit)
    results = eng.generate(reqs)
    monkeypatch.undo()
    assert [res.error.code if res.error else None for res in results] == codes
    assert all(res.error.retriable for res in results if res.error)
    assert eng.stats()["kv_pool_used_blocks"] == 0
    for r, res in zip(reqs, results):  # the items run again in halves write the same KV: outputs as alone
        assert not res.ok or res.output_ids == alone(eng, r).output_ids, r.request_id


async def test_through_the_async_engine_every_future_settles(eng, monkeypatch):
    """Twelve callers, three of them "bad-*" whose presence makes the forward raise: each of those fails with
    forward_failed, the nine others succeed, every awaited generate settles, and the loop serves the next caller.
    (The good ones run long enough that no bad one is ever alone in a step: alone, it would be engine_failed.)"""
    reqs = [req(f"{'bad' if i % 4 == 1 else 'ok'}-{i}", prompt=TEXTS[i % len(TEXTS)], tenant_id=f"t{i % 3}",
                max_new_tokens=4 if i % 4 == 1 else 20 + i % 4, **({"temperature": 0.9, "seed": i} if i % 3 == 0 else {}))
            for i in range(12)]  # fmt: skip
    real = eng.runner.forward

    def forward(items, **kw):
        bad = {s.seq_id for s in eng._unfinished.values() if s.request_id.startswith("bad")}
        if any(it.seq_id in bad for it in items):
            raise RuntimeError("simulated fault of one request's rows")
        return real(items, **kw)

    monkeypatch.setattr(eng.runner, "forward", forward)

    async def submit(i, r):
        await asyncio.sleep(0.003 * i)
        return await ae.generate(r)

    async with AsyncEngine(eng) as ae:
        results = await asyncio.wait_for(asyncio.gather(*(submit(i, r) for i, r in enumerate(reqs))), 120)
        monkeypatch.undo()
        after = await ae.generate(req("after", max_new_tokens=3))
        assert ae.alive
    for r, res in zip(reqs, results):
        if r.request_id.startswith("bad"):
            assert res.error is not None and res.error.code == "forward_failed", (r.request_id, res.error)
        else:
            assert res.ok and res.output_ids == alone(eng, r).output_ids, (r.request_id, res.error)
    assert after.ok and eng.stats()["kv_pool_used_blocks"] == 0


async def test_a_step_that_raises_outside_isolation_fails_everyone_and_the_loop_goes_on(eng, monkeypatch):
    """The last resort: a step raising anyway (a scheduler bug) fails every caller in flight with engine_failed
    (retriable) and the engine thread serves the next requests."""
    real = eng.planner.schedule
    raised = []

    def schedule():
        if len(eng._unfinished) == 3 and not raised and eng.stats()["steps"] > 0:
            raised.append(True)
            raise RuntimeError("simulated scheduler bug")
        return real()

    monkeypatch.setattr(eng.planner, "schedule", schedule)
    async with AsyncEngine(eng) as ae:
        results = await asyncio.wait_for(asyncio.gather(*(ae.generate(req(f"s{i}", tenant_id="t", max_new_tokens=8)) for i in range(3))), 60)
        assert all(res.error is not None and res.error.code == "engine_failed" and res.error.retriable for res in results)
        assert ae.alive
        assert (await ae.generate(req("next", max_new_tokens=3))).ok
    assert not eng.has_unfinished() and eng.stats()["kv_pool_used_blocks"] == 0


@pytest.mark.parametrize(
    ("where", "code"),
    [("tokenizer", "admission_failed"), ("adapter", "adapter_load_failed")],
)
def test_an_admission_that_raises_fails_that_request_alone(demo_set, monkeypatch, where, code):
    """Encoding a prompt that raises, or acquiring an adapter that raises unexpectedly, fails that request with its
    code; the others run. adapter_load_failed counts against the adapter (ADAPTER_ERROR_CODES)."""
    e = demo_engine(demo_set, register_only=True)
    reqs = _batch()
    if where == "tokenizer":
        real_encode = e.tokenizer.encode

        def encode(text, **kw):
            if text == TEXTS[2]:  # "bad"'s prompt
                raise ValueError("simulated tokenizer fault")
            return real_encode(text, **kw)

        monkeypatch.setattr(e.tokenizer, "encode", encode)
    else:
        real_acquire = e.adapters.acquire

        def acquire(key):
            if key == "qv-r4":  # "bad"'s adapter
                raise MemoryError("simulated fault while loading")
            return real_acquire(key)

        monkeypatch.setattr(e.adapters, "acquire", acquire)
    results = e.generate(reqs)
    assert [res.error.code if res.error else None for res in results] == [None, code, None, None]
    assert (code in ADAPTER_ERROR_CODES) == (where == "adapter")


def test_adapter_error_codes_are_the_adapters_own_faults():
    """ADAPTER_ERROR_CODES holds every code the adapter loading paths raise for the adapter's content or files, and
    none of the caller's mistakes."""
    raised = set()
    for path in ENGINE_DIR.glob("*.py"):  # every engine module, wherever a raise moves to
        raised |= set(re.findall(r'code="(adapter_[a-z_]+)"', path.read_text()))
    callers = {"adapter_key_in_use", "adapter_in_use"}  # calls made wrongly, not the adapter's fault
    assert raised - callers <= ADAPTER_ERROR_CODES, raised - callers - ADAPTER_ERROR_CODES
    assert not ADAPTER_ERROR_CODES & {"unknown_adapter", "adapter_in_use", "adapter_key_in_use", "invalid_slo_tier", "aborted",
                                      "engine_failed", "forward_failed", "sampling_failed", "duplicate_request_id"}  # fmt: skip
