"""Engine behaviour on the demo model: determinism, sampling, stopping, logprobs, errors, timings, adapters."""

from __future__ import annotations

import dataclasses
import json
import shutil
import time

import pytest
import torch

from engine.api import AdapterError, GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.runner import BatchItem
from engine.timing import apportion

PROMPTS = [
    "The lighthouse keeper climbed",
    "A good recipe for soup needs",
    "The river runs through",
    "Numbers are everywhere",
    "The library was open",
]


def _config(demo_set, **kw) -> EngineConfig:
    base = dict(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=64, max_new_tokens=32, max_batch_size=16, kv_block_size=8)
    return EngineConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(demo_set):
    eng = Engine(_config(demo_set))
    for name, path in demo_set["adapters"].items():
        eng.load_adapter(name, path)
    return eng


def _req(rid: str, prompt: str = PROMPTS[0], adapter_key: str | None = None, **sampling) -> GenerationRequest:
    sampling.setdefault("max_new_tokens", 12)
    return GenerationRequest(request_id=rid, prompt=prompt, adapter_key=adapter_key, sampling=SamplingParams(**sampling))


def _companions(prefix: str) -> list[GenerationRequest]:
    """Other traffic: mixed adapters, prompts, greedy and sampled."""
    return [
        _req(f"{prefix}-c0", PROMPTS[1], "all-r16"),
        _req(f"{prefix}-c1", PROMPTS[2], "mlp-r64", temperature=1.0, seed=5),
        _req(f"{prefix}-c2", PROMPTS[3], None, max_new_tokens=3),
        _req(f"{prefix}-c3", PROMPTS[4], "qv-r4", temperature=0.8, top_p=0.9),
    ]


# ---- determinism and sampling


@pytest.mark.parametrize("adapter", [None, "qkvo-r64-rslora"])
def test_greedy_is_deterministic_whatever_the_batch(engine, adapter):
    """The same greedy request gives the same tokens alone, among companions, and again."""
    alone = engine.generate([_req("g-a", adapter_key=adapter)])[0]
    mixed = engine.generate(_companions("g") + [_req("g-b", adapter_key=adapter)])[-1]
    again = engine.generate([_req("g-c", adapter_key=adapter)])[0]
    assert alone.ok and alone.output_ids == mixed.output_ids == again.output_ids


def test_logprobs_batched_are_within_1e5_of_alone(engine):
    """The README's tolerance on the CPU: base-model and adapter jobs batched together get the tokens they get alone,
    and each logprob within 1e-5 of it."""
    jobs = [_req("lp-base", PROMPTS[0], None, logprobs=2), _req("lp-r64", PROMPTS[1], "mlp-r64", logprobs=2),
            _req("lp-base-s", PROMPTS[2], None, temperature=0.8, seed=3, logprobs=2),
            _req("lp-rs", PROMPTS[3], "qkvo-r64-rslora", temperature=0.8, seed=4, logprobs=2)]  # fmt: skip
    batched = {r.request_id: r for r in engine.generate(jobs + _companions("lp"))}
    for job in jobs:
        alone = engine.generate([dataclasses.replace(job, request_id=job.request_id + "-alone")])[0]
        got = batched[job.request_id]
        assert got.ok and got.output_ids == alone.output_ids
        diffs = [abs(a["logprob"] - b["logprob"]) for a, b in zip(got.logprobs["content"], alone.logprobs["content"])]
        assert len(diffs) == len(alone.output_ids) and max(diffs) < 1e-5, diffs


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=1.0), dict(temperature=0.7, top_k=20), dict(temperature=1.2, top_p=0.9), dict(temperature=1.0, top_k=50, top_p=0.95)],
    ids=["temp", "top_k", "top_p", "top_k+top_p"],
)
def test_seeded_sampling_is_reproducible_and_independent_of_companions(engine, sampling):
    """Same seed + prompt -> same tokens, alone or in a busy mixed batch; another seed -> other tokens."""
    alone = engine.generate([_req("s-a", adapter_key="all-r8-rslora", seed=1234, ignore_eos=True, **sampling)])[0]
    mixed = engine.generate(_companions("s") + [_req("s-b", adapter_key="all-r8-rslora", seed=1234, ignore_eos=True, **sampling)])[-1]
    other = engine.generate([_req("s-c", adapter_key="all-r8-rslora", seed=99, ignore_eos=True, **sampling)])[0]
    assert alone.output_ids == mixed.output_ids
    assert alone.output_ids != other.output_ids


def test_top_k_1_equals_greedy(engine):
    """Sampling with top_k=1 at a high temperature returns the greedy tokens."""
    greedy = engine.generate([_req("k-g", adapter_key="qv-r16")])[0]
    topk1 = engine.generate([_req("k-1", adapter_key="qv-r16", temperature=1.5, top_k=1, seed=3)])[0]
    assert greedy.output_ids == topk1.output_ids


# ---- stopping


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_length_stops_at_max_new_tokens(engine, max_new_tokens):
    """Without EOS or stop strings a request ends with exactly max_new_tokens tokens, finish_reason 'length'."""
    res = engine.generate([_req("len", PROMPTS[2], max_new_tokens=max_new_tokens, ignore_eos=True)])[0]
    assert res.finish_reason == "length" and len(res.output_ids) == max_new_tokens
    t = res.timings
    assert t.prefill_tokens + t.cached_tokens == res.prompt_tokens and t.decode_tokens == max_new_tokens - 1


@pytest.mark.parametrize("start", [3, 8])
def test_stop_string_truncates_text_before_it(engine, start):
    """The text ends right before the first occurrence of a stop string; generation ends early with 'stop'."""
    full = engine.generate([_req("st-full", PROMPTS[1], max_new_tokens=24, ignore_eos=True)])[0]
    stop = full.text[start : start + 3]
    assert len(stop) == 3, full.text
    res = engine.generate([_req("st", PROMPTS[1], max_new_tokens=24, ignore_eos=True, stop=("never-in-output", stop))])[0]
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.find(stop)]
    assert res.output_ids == full.output_ids[: len(res.output_ids)] and len(res.output_ids) < 24


def test_eos_ends_generation_and_ignore_eos_runs_on(engine, demo_set, tmp_path):
    """When the model samples an EOS id, the request ends with 'eos' (EOS in output_ids, not in text);
    ignore_eos keeps going to max_new_tokens."""
    full = engine.generate([_req("e-full", PROMPTS[0], max_new_tokens=10, ignore_eos=True)])[0]
    k = next(i for i, t in enumerate(full.output_ids) if i >= 2 and t not in full.output_ids[:i])
    # A copy of the model whose EOS is the token greedy decoding emits at step k.
    model_dir = tmp_path / "model"
    shutil.copytree(demo_set["model"], model_dir)
    gen_cfg = json.loads((model_dir / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = full.output_ids[k]
    (model_dir / "generation_config.json").write_text(json.dumps(gen_cfg))
    eng = Engine(_config(demo_set, model_dir=str(model_dir)))

    res = eng.generate([_req("e", PROMPTS[0], max_new_tokens=10)])[0]
    assert res.finish_reason == "eos"
    assert res.output_ids == full.output_ids[: k + 1]
    assert res.text == eng.tokenizer.decode(full.output_ids[:k])
    ignored = eng.generate([_req("e-i", PROMPTS[0], max_new_tokens=10, ignore_eos=True)])[0]
    assert ignored.finish_reason == "length" and ignored.output_ids == full.output_ids


# ---- logprobs


@pytest.mark.parametrize("sampling", [dict(), dict(temperature=1.5, seed=8)], ids=["greedy", "sampled"])
def test_logprobs_shape_and_values(engine, sampling):
    """One OpenAI-shaped entry per token; the chosen token's logprob is log_softmax of the raw (untempered) logits."""
    res = engine.generate([_req("lp", PROMPTS[3], "qkvo-r8", logprobs=3, max_new_tokens=6, ignore_eos=True, **sampling)])[0]
    content = res.logprobs["content"]
    assert len(content) == len(res.output_ids) == 6
    prompt = engine.tokenizer.encode(PROMPTS[3])
    slot = engine.adapters.acquire("qkvo-r8")[0]
    try:
        logits = engine.runner.forward([BatchItem("lp-check", tuple(prompt + res.output_ids), 0, slot)], all_logits=True)
    finally:
        engine.runner.free("lp-check")
        engine.adapters.release(engine.adapters.sha_of("qkvo-r8"))
    logp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # [6, V]: the distribution each token was drawn from
    for i, (entry, token) in enumerate(zip(content, res.output_ids)):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert bytes(entry["bytes"]) == engine.tokenizer.token_bytes(token)
        assert entry["logprob"] == pytest.approx(float(logp[i, token]), abs=1e-4)
        tops = entry["top_logprobs"]
        assert len(tops) == 3 and [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
        assert tops[0]["logprob"] == pytest.approx(float(logp[i].max()), abs=1e-4)
        if not sampling:
            assert tops[0]["bytes"] == entry["bytes"]


# ---- per-request errors


BAD = [
    (dict(prompt="word " * 200), "prompt_too_long"),
    (dict(prompt="hi", sampling=SamplingParams(max_new_tokens=33)), "max_new_tokens_too_large"),
    (dict(prompt="hi", adapter_key="no-such-adapter"), "unknown_adapter"),
    (dict(prompt=""), "empty_prompt"),
    (dict(input_ids=()), "empty_prompt"),
    (dict(messages=()), "empty_prompt"),
    (dict(input_ids=(1, 5, 10**6)), "invalid_input_ids"),
    (dict(input_ids=(1, -3)), "invalid_input_ids"),
    (dict(prompt="hi", input_ids=(1, 2)), "invalid_request"),
    (dict(), "invalid_request"),
    (dict(prompt="hi", sampling=SamplingParams(max_new_tokens=8, temperature=-1.0)), "invalid_sampling_params"),
    (dict(prompt="hi", sampling=SamplingParams(max_new_tokens=8, top_p=0.0)), "invalid_sampling_params"),
    (dict(prompt="hi", sampling=SamplingParams(max_new_tokens=8, stop=("",))), "invalid_sampling_params"),
    (dict(messages=({"role": "wizard", "content": "hi"},)), "invalid_messages"),
    (dict(messages=({"role": "user"},)), "invalid_messages"),
]


def test_bad_requests_fail_alone_and_good_ones_are_unaffected(engine):
    """Each invalid request yields a result with its error code; the valid requests in the same call
    produce exactly what they produce alone."""
    good = [_req(f"ok{i}", p, a) for i, (p, a) in enumerate(zip(PROMPTS, ["qv-r4", None, "mlp-r4", "all-r16", None]))]
    bad = [GenerationRequest(request_id=f"bad{i}", **{"sampling": SamplingParams(max_new_tokens=8), **kw}) for i, (kw, _) in enumerate(BAD)]
    mixed = [r for pair in zip(good, bad) for r in pair] + bad[len(good) :]
    results = engine.generate(mixed)
    assert [r.request_id for r in results] == [r.request_id for r in mixed]
    by_id = {r.request_id: r for r in results}
    for req, (_, code) in zip(bad, BAD):
        res = by_id[req.request_id]
        assert res.error is not None and res.error.code == code, (req, res.error)
        assert res.error.message and not res.output_ids
    for req in good:
        alone = engine.generate([GenerationRequest(request_id=req.request_id + "-alone", prompt=req.prompt, adapter_key=req.adapter_key, sampling=req.sampling)])[0]
        assert by_id[req.request_id].ok and by_id[req.request_id].output_ids == alone.output_ids
    assert not engine.has_unfinished()


def test_duplicate_request_id_in_one_generate_fails_only_the_second(engine):
    res = engine.generate([_req("dup"), _req("dup", PROMPTS[1])])
    assert res[0].ok and res[1].error.code == "duplicate_request_id"


def test_chat_messages_equal_their_rendered_input_ids(engine):
    """A messages request runs the chat template: same output as sending the template's token ids."""
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is soup?"})
    sp = SamplingParams(max_new_tokens=8)
    a = engine.generate([GenerationRequest(request_id="chat", messages=messages, adapter_key="qv-r16", sampling=sp)])[0]
    ids = tuple(engine.tokenizer.encode_chat(messages))
    b = engine.generate([GenerationRequest(request_id="chat-ids", input_ids=ids, adapter_key="qv-r16", sampling=sp)])[0]
    assert a.ok and a.prompt_tokens == len(ids) and a.output_ids == b.output_ids


def test_messages_that_render_to_no_tokens_fail_alone_with_empty_prompt(demo_set, tmp_path):
    """A chat template that writes out none of a request's messages (here, one that renders user turns' content alone)
    gives no prompt tokens: the request fails with empty_prompt, alone in its step or beside others, and its batchmates
    get what they get alone. It reached the forward before: forward_failed beside others, and alone its step raised
    while splitting its time over no tokens, which fails every request in the engine (engine_failed, retriable)."""
    model = shutil.copytree(demo_set["model"], tmp_path / "model")
    tokenizer_config = json.loads((model / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    eng = Engine(_config(demo_set, model_dir=str(model)))

    def chat(rid: str, *messages: dict) -> GenerationRequest:
        return GenerationRequest(request_id=rid, messages=messages, sampling=SamplingParams(max_new_tokens=4))

    eng.add_request(chat("system-only", {"role": "system", "content": "Be brief."}))
    (alone_in_its_step,) = eng.step()
    assert alone_in_its_step.error is not None and alone_in_its_step.error.code == "empty_prompt", alone_in_its_step.error
    assert "chat template" in alone_in_its_step.error.message and not eng.has_unfinished()
    good = [chat("user", {"role": "user", "content": PROMPTS[1]}), _req("text", PROMPTS[2], max_new_tokens=4)]
    results = {r.request_id: r for r in eng.generate([good[0], chat("empty-user", {"role": "user", "content": ""}), good[1]])}
    assert results["empty-user"].error is not None and results["empty-user"].error.code == "empty_prompt"
    for r in good:
        ref = eng.generate([dataclasses.replace(r, request_id=r.request_id + "-alone")])[0]
        assert results[r.request_id].ok and results[r.request_id].output_ids == ref.output_ids


# ---- timings


@pytest.mark.parametrize(
    ("total", "weights", "parts"),
    [
        (100, [1, 1, 1], [34, 33, 33]),
        (10, [5, 0, 5], [5, 0, 5]),
        (7, [3], [7]),
        (0, [2, 3], [0, 0]),
        (0, [], []),
        (1, [1, 1], [1, 0]),
        (999, [6, 1, 1, 1], [666, 111, 111, 111]),
        (1001, [2, 3, 5], [200, 300, 501]),
    ],
)
def test_apportion_sums_exactly(total, weights, parts):
    """Largest remainder: parts are floor shares plus one unit to the largest remainders, summing to total."""
    assert apportion(total, weights) == parts
    assert sum(parts) == total


def test_step_shares_sum_exactly_to_measured_step_times(demo_set):
    """Per step: base shares sum to base_us, LoRA shares to lora_us (only adapter rows get any), base + lora = total;
    per request: its timings are the sum of its shares, and its tokens the sum of its step tokens."""
    eng = Engine(_config(demo_set, max_batch_size=3))
    for name in ("qv-r4", "mlp-r64"):
        eng.load_adapter(name, demo_set["adapters"][name])
    reqs = [_req(f"t{i}", PROMPTS[i % 5], [None, "qv-r4", "mlp-r64"][i % 3], max_new_tokens=3 + i, ignore_eos=True) for i in range(7)]
    results = eng.generate(reqs)
    records = eng.pop_step_records()
    assert records and not eng.step_records
    for rec in records:
        assert rec.base_us + rec.lora_us == rec.total_us
        assert sum(s.base_us for s in rec.shares) == rec.base_us
        assert sum(s.lora_us for s in rec.shares) == rec.lora_us
        assert rec.tokens == sum(s.tokens for s in rec.shares)
        assert rec.lora_tokens == sum(s.tokens for s in rec.shares if s.has_lora)
        assert all(s.lora_us == 0 for s in rec.shares if not s.has_lora)
        assert (rec.lora_us > 0) == (rec.lora_tokens > 0)  # base-only steps skip LoRA entirely
    for res in results:
        mine = [s for rec in records for s in rec.shares if s.request_id == res.request_id]
        t = res.timings
        assert t.base_us == sum(s.base_us for s in mine) and t.lora_us == sum(s.lora_us for s in mine)
        assert t.steps == len(mine) and t.prefill_tokens + t.decode_tokens == sum(s.tokens for s in mine)
        assert 0 <= t.queue_us <= t.ttft_us <= t.total_us
    assert sum(r.timings.base_us + r.timings.lora_us for r in results) == sum(rec.total_us for rec in records)


def test_decode_only_steps_do_not_move_the_prefill_cost_fit(engine):
    """The KV credit's per-token rate is the slope of prefill step time against tokens (engine.booking): a step that
    holds prompt tokens feeds the fit, a step of decodes alone leaves it exactly as it was."""
    engine.pop_step_records()
    fit = engine.book.prefill_cost
    engine.add_request(_req("fit-0", PROMPTS[2], max_new_tokens=6, ignore_eos=True))
    engine.add_request(_req("fit-1", PROMPTS[3], "qv-r4", max_new_tokens=6, ignore_eos=True))
    state = dict(vars(fit))
    engine.step()  # both prompts, whole
    assert vars(fit) != state
    state = dict(vars(fit))
    while engine.has_unfinished():
        engine.step()
    records = engine.pop_step_records()
    assert len(records) == 6 and all(r.tokens == 2 for r in records[1:]), [r.tokens for r in records]  # 5 decode steps
    assert vars(fit) == state


def test_a_step_waits_for_its_adapter_copies_before_its_timing_starts(demo_set):
    """The compute stream's wait for the pages of an adapter loaded at its request's admission is queued before the
    step's timed section opens, never inside it: on CUDA the copy runs on the side stream and is billed as the load,
    so a section opened first measured the GPU's wait for it as the step's time too, billed again to every request
    of the step. (On the CPU the wait is a no-op; the order of the calls is what the stream runs.)"""
    eng = Engine(_config(demo_set, max_loras=1))
    eng.register_adapter("mlp-r64", demo_set["adapters"]["mlp-r64"])
    calls: list[tuple] = []
    wait_ready, begin = eng.runner.lora.wait_ready, eng._step_timer.begin
    eng.runner.lora.wait_ready = lambda slots: calls.append(("wait", tuple(slots))) or wait_ready(())
    eng._step_timer.begin = lambda: calls.append(("begin",)) or begin()
    eng.add_request(_req("cold", PROMPTS[1], "mlp-r64", max_new_tokens=2))
    eng.step()  # admits it, loading the adapter into slot 0, and runs its prompt
    assert eng.pop_load_events(), "the adapter was loaded at the admission"
    assert calls.index(("wait", (0,))) < calls.index(("begin",)), calls


def test_queue_time_counts_from_arrival(engine):
    """arrival_us (monotonic) in the past is counted into queue, ttft and total time."""
    past = time.monotonic_ns() // 1000 - 5_000_000
    res = engine.generate([GenerationRequest(request_id="arr", prompt="hi", arrival_us=past, sampling=SamplingParams(max_new_tokens=2))])[0]
    assert res.timings.queue_us >= 5_000_000 and res.timings.total_us >= res.timings.ttft_us >= res.timings.queue_us


# ---- adapters


def test_same_content_under_two_keys_is_loaded_once(engine, demo_set, tmp_path):
    """A copy of an adapter under a new key shares the sha, the slot and the outputs; nothing new is loaded."""
    copy = shutil.copytree(demo_set["adapters"]["all-r16"], tmp_path / "copy")
    (copy / "README.md").write_text("extra files do not change the identity\n")
    resident = dict(engine.adapters.resident())
    info = engine.load_adapter("tenant-b/alias@1", copy)
    orig = engine.adapters.info("all-r16")
    assert info.sha256 == orig.sha256 and info.tier == "gpu" and info.nbytes == orig.nbytes
    assert engine.adapters.resident() == resident
    a, b = engine.generate([_req("k1", adapter_key="all-r16"), _req("k2", adapter_key="tenant-b/alias@1")])
    assert a.output_ids == b.output_ids
    assert b.timings.adapter_load_us == 0
    engine.unload_adapter("tenant-b/alias@1")
    assert not engine.has_adapter("tenant-b/alias@1") and engine.has_adapter("all-r16")
    assert engine.adapters.resident() == resident


def test_few_slots_evict_and_page_in_without_changing_results(engine, demo_set):
    """With 2 slots and 3 adapters in one call, requests wait for a slot, adapters are evicted and paged back,
    and every output equals the one computed with all adapters resident; the disk load is charged once."""
    eng = Engine(_config(demo_set, max_loras=2))
    names = ["qv-r4", "all-r8-rslora", "mlp-r64"]
    infos = [eng.load_adapter(n, demo_set["adapters"][n]) for n in names]
    assert [i.tier for i in infos] == ["disk"] * 3 and len(eng.adapters.resident()) == 2
    reqs = [_req(f"ev{i}", PROMPTS[i % 5], names[i % 3], max_new_tokens=4 + i % 3) for i in range(9)]
    got = eng.generate(reqs)
    want = engine.generate([_req(r.request_id + "-ref", r.prompt, r.adapter_key, max_new_tokens=r.sampling.max_new_tokens) for r in reqs])
    assert [g.output_ids for g in got] == [w.output_ids for w in want]
    charged = [g.timings.adapter_load_us for g in got[:3]]
    assert all(c > 0 for c in charged), charged  # the first request of each adapter pays its load
    assert all(g.timings.adapter_load_us == 0 for g in got[3:6] if g.adapter_key == "qv-r4")


def test_unload_refuses_adapters_in_use_and_abort_frees_everything(engine, demo_set):
    """An adapter with unfinished requests cannot be unloaded; abort returns the partial result and frees KV and pins."""
    eng = Engine(_config(demo_set, max_loras=1))
    eng.load_adapter("a", demo_set["adapters"]["qv-r4"])
    free_blocks = eng.runner.blocks.num_free
    eng.add_request(_req("ab", adapter_key="a", max_new_tokens=20, ignore_eos=True))
    eng.step()
    with pytest.raises(AdapterError) as e:
        eng.unload_adapter("a")
    assert e.value.code == "adapter_in_use"
    res = eng.abort("ab")
    assert res.error.code == "aborted" and len(res.output_ids) == 1
    assert eng.abort("ab") is None
    assert eng.runner.blocks.num_free == free_blocks and not eng.has_unfinished()
    eng.unload_adapter("a")
    assert not eng.has_adapter("a") and eng.adapters.resident() == {}
