"""Continuous batching: requests join mid-way, prefills are chunked, KV pressure preempts, and no output changes."""

from __future__ import annotations

import math
import random
import types

import pytest

from engine import timing
from engine.api import EngineError
from engine.engine import Engine
from tests.test_serving_helpers import TEXTS, alone, config, demo_engine, req, run_until_done

ADAPTERS = ["qv-r4", "qkvo-r8", "all-r16", "mlp-r64", "all-r8-rslora"]


@pytest.fixture(scope="module")
def reference(demo_set):
    """Every request alone: one at a time, whole prompts in one step, no prefix cache."""
    return demo_engine(demo_set, enable_prefix_caching=False, max_num_batched_tokens=4096)


def _workload() -> list:
    """Mixed adapters, short and long prompts (up to 60 tokens), greedy and seeded sampling."""
    rng = random.Random(3)
    reqs = []
    for i in range(12):
        kind = i % 3
        kw = dict(adapter_key=[None, *ADAPTERS][i % 6], max_new_tokens=6 + (i * 5) % 17)
        if i % 5 == 4:
            kw.update(temperature=0.9, top_p=0.95, seed=100 + i)
        if kind == 0:
            reqs.append(req(f"w{i}", input_ids=tuple(rng.randrange(4, 500) for _ in range(40 + i)), **kw))
        else:
            reqs.append(req(f"w{i}", prompt=TEXTS[i % len(TEXTS)], **kw))
    return reqs


def test_joining_midway_chunked_prefill_and_preemption_change_no_output(demo_set, reference):
    """Requests added between steps, prefills cut into 16-token chunks, and a KV pool too small for the
    batch (forcing preemption and recompute) give every request exactly the tokens it gets alone."""
    # 26 blocks of 4 tokens: one 96-token sequence fits; a dozen at once do not.
    eng = Engine(config(demo_set, max_num_batched_tokens=16, kv_num_blocks=26, max_loras=4))
    for name in ADAPTERS:
        eng.load_adapter(name, demo_set["adapters"][name])
    reqs = _workload()
    waves = [reqs[:3], reqs[3:7], reqs[7:]]
    results = {}
    steps = 0
    while waves or eng.has_unfinished():
        if waves and steps % 3 == 0:
            for r in waves.pop(0):
                eng.add_request(r)
        for res in eng.step():
            results[res.request_id] = res
        steps += 1
        used = eng.runner.blocks.num_used
        assert used <= eng.runner.blocks.num_blocks
    stats = eng.stats()
    assert stats["preemptions"] > 0, "the pool was meant to be too small for the batch"
    assert stats["kv_pool_used_blocks"] == 0 and stats["lora_slots_pinned"] == 0
    for r in reqs:
        res = results[r.request_id]
        assert res.ok, res.error
        assert res.output_ids == alone(reference, r).output_ids, r.request_id
        prompt_len = res.prompt_tokens
        # chunked: a prompt over the 16-token budget took several steps before its first token
        assert res.timings.steps >= math.ceil((prompt_len - res.timings.cached_tokens) / 16) + len(res.output_ids) - 1
    assert any(results[r.request_id].timings.preemptions > 0 for r in reqs)
    for rec in eng.pop_step_records():
        assert rec.tokens <= 16


def test_the_lowest_priority_running_request_is_preempted(demo_set, reference):
    """Three requests grow past the pool: the lowest priority one is preempted (and recomputed), the others never;
    all three still produce their tokens alone."""
    eng = Engine(config(demo_set, kv_num_blocks=26, enable_prefix_caching=False))
    eng.load_adapter("qv-r16", demo_set["adapters"]["qv-r16"])
    reqs = [
        req("p-high", input_ids=tuple(range(10, 30)), priority=10, max_new_tokens=32, adapter_key="qv-r16"),
        req("p-low", input_ids=tuple(range(50, 70)), priority=0, max_new_tokens=32),
        req("p-mid", input_ids=tuple(range(90, 110)), priority=5, max_new_tokens=32, adapter_key="qv-r16"),
    ]
    for r in reqs:
        eng.add_request(r)
    results = run_until_done(eng)
    assert results["p-low"].timings.preemptions > 0
    assert results["p-high"].timings.preemptions == 0 and results["p-mid"].timings.preemptions == 0
    for r in reqs:
        assert results[r.request_id].output_ids == alone(reference, r).output_ids, r.request_id


def test_abort_mid_prefill_frees_blocks_and_slots(demo_set):
    """Aborting a request halfway through its chunked prefill returns it with code `aborted` and no tokens, and
    leaves no KV block or adapter pin behind; the other request is unaffected."""
    eng = Engine(config(demo_set, max_num_batched_tokens=8, max_loras=1))
    eng.load_adapter("a", demo_set["adapters"]["all-r16"])
    eng.add_request(req("long", input_ids=tuple(range(4, 60)), adapter_key="a", max_new_tokens=4))
    eng.add_request(req("other", max_new_tokens=4))
    eng.step()
    eng.step()
    assert eng.stats()["lora_slots_pinned"] == 1
    res = eng.abort("long")
    assert res.error.code == "aborted" and res.output_ids == []
    done = run_until_done(eng)
    assert done["other"].ok and len(done["other"].output_ids) == 4
    stats = eng.stats()
    assert stats["kv_pool_used_blocks"] == 0 and stats["lora_slots_pinned"] == 0 and not eng.has_unfinished()


def test_every_step_keeps_to_the_token_budget_and_batch_size(demo_set):
    """No step computes more than max_num_batched_tokens tokens or runs more than max_batch_size requests."""
    eng = Engine(config(demo_set, max_num_batched_tokens=24, max_batch_size=3))
    results = eng.generate([req(f"b{i}", prompt=TEXTS[i % len(TEXTS)], max_new_tokens=5) for i in range(7)])
    assert all(r.ok for r in results)
    records = eng.pop_step_records()
    assert records and all(rec.tokens <= 24 and len(rec.shares) <= 3 for rec in records)
    assert max(rec.tokens for rec in records) > 3, "prefill chunks should fill the budget, not trickle"


def test_a_tenant_quota_below_one_sequence_is_refused_at_start(demo_set):
    """A per-tenant quota that could not hold one longest sequence would strand requests: the engine refuses it,
    naming the quota and the blocks needed."""
    eng = Engine(config(demo_set, kv_num_blocks=40, kv_tenant_quota=0.6))  # 24 blocks: one 96-token sequence
    assert eng.generate([req("fits", input_ids=tuple(range(4, 68)), max_new_tokens=32, tenant_id="t")])[0].ok
    with pytest.raises(EngineError) as e:
        Engine(config(demo_set, kv_num_blocks=40, kv_tenant_quota=0.5))  # 20 blocks
    assert e.value.code == "config_invalid" and "kv_tenant_quota=0.5" in str(e.value) and "24" in str(e.value)


def test_stats_export_the_pool_gauges(demo_set, monkeypatch):
    """stats() carries the gauges the consumer exports (KV pool use and hit rate, warm-pool hit rate, LoRA memory,
    loads by tier, the marginal prefill cost), with values that follow the engine's state.

    The prefill cost is the slope of prefill step time against tokens (engine.timing.PrefillCost). On the demo model a
    token costs microseconds against the milliseconds of a step's fixed part, so the wall times of the two prefill steps
    here (14 tokens, then 2 past the prefix hit) are ordered by CPU scheduling, not by tokens: on two busy cores the
    2-token step at times took longer, and the slope, floored at 0 by design, was 0. So the steps' clock (DeviceTimer:
    perf_counter_ns on the CPU) reads a simulated device here, on which a forward of n tokens takes
    fixed_us + per_token_us * n, and the fit must find per_token_us."""
    fixed_us, per_token_us = 500, 20
    now_ns = [0]
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter_ns=lambda: now_ns[0]))
    eng = Engine(config(demo_set))
    forward = eng.runner.forward

    def timed_forward(items, **kw):
        now_ns[0] += (fixed_us + per_token_us * sum(len(it.token_ids) for it in items)) * 1000
        return forward(items, **kw)

    monkeypatch.setattr(eng.runner, "forward", timed_forward)
    eng.register_adapter("a", demo_set["adapters"]["qv-r16"], tenant_id="t")
    empty = eng.stats()
    assert empty["kv_pool_used_blocks"] == 0 and empty["kv_pool_hit_rate"] == 0.0 and empty["lora_memory_used_bytes"] == 0
    assert empty["prefill_us_per_token"] is None
    eng.add_request(req("s1", adapter_key="a", tenant_id="t", max_new_tokens=4))
    eng.step()
    mid = eng.stats()
    assert mid["prefill_us_per_token"] is None  # one prefill step, one token count: no slope yet, so no KV credit
    assert mid["running"] == 1 and mid["kv_pool_used_blocks"] > 0 and mid["kv_tenant_used_blocks"] == {"t": mid["kv_pool_used_blocks"]}
    assert mid["lora_memory_used_bytes"] > 0 and mid["adapter_loads"] == {"disk": 1, "host": 0} and mid["lora_slots_pinned"] == 1
    run_until_done(eng)
    eng.generate([req("s2", adapter_key="a", tenant_id="t", max_new_tokens=4)])
    end = eng.stats()
    assert end["kv_pool_used_blocks"] == 0 and end["kv_pool_cached_blocks"] > 0 and 0 < end["kv_pool_hit_rate"] < 1
    assert end["warm_pool_hits"] == 1 and end["warm_pool_misses"] == 1 and end["warm_pool_hit_rate"] == 0.5
    assert end["prefill_us_per_token"] == pytest.approx(per_token_us) and end["steps"] >= 8
