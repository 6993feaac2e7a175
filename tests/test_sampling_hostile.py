"""A job's sampling parameters at their extremes, on the CPU engine: seeds over the whole contract range, and one
batch mixing every extreme and malformed value, in which each bad request fails alone."""

from __future__ import annotations

import math

import pytest
import torch

from engine.api import GenerationRequest, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling import seeded_generator

PROMPT = "The river runs through"


@pytest.fixture(scope="module")
def engine(demo_set):
    return Engine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=64, max_new_tokens=32,
                               max_batch_size=16, kv_block_size=8))  # fmt: skip


def _req(rid: str, prompt: object = PROMPT, **sampling) -> GenerationRequest:
    sampling.setdefault("max_new_tokens", 8)
    sampling.setdefault("ignore_eos", True)
    given = {"input_ids": tuple(prompt)} if isinstance(prompt, list) else {"prompt": prompt}
    return GenerationRequest(request_id=rid, sampling=SamplingParams(**sampling), **given)


# ---- seeds: every bit of the contract's 63 counts


# torch's CPU generator (mt19937) keeps only a seed's low 32 bits: each of these drew exactly as seed 5 did
SEEDS_LIKE_5 = [5 + 2**32, 5 + 2**33, 5 + 7 * 2**32, 5 + 2**62, 5 + (2**63 - 2**32)]


def test_seeds_that_differ_above_32_bits_draw_differently(engine):
    """Seeds 5 and 5 + k * 2**32 are different seeds of the contract; each gets its own tokens (they all got seed 5's)."""
    jobs = [_req(f"s{i}", temperature=5.0, seed=seed) for i, seed in enumerate([5, *SEEDS_LIKE_5])]
    got = [tuple(r.output_ids) for r in engine.generate(jobs)]
    assert len(set(got)) == len(got), got


def test_seeds_below_2_32_draw_as_before(engine):
    """Seeds a producer already used (0..2**32 - 1) keep their tokens: the generator is seeded with the seed itself."""
    for seed in (0, 42, 2**32 - 1):
        g = seeded_generator(seed, torch.device("cpu"))
        assert torch.equal(torch.rand(8, generator=g), torch.rand(8, generator=torch.Generator().manual_seed(seed)))


@pytest.mark.parametrize("seed", [0, 1, 2**32, 2**63 - 1, 2**64, -1, 10**40])
def test_seeded_generator_takes_any_int(seed):
    """Every int the engine lets through seeds a generator, the same one each time."""
    a, b = (torch.rand(4, generator=seeded_generator(seed, torch.device("cpu"))) for _ in range(2))
    assert torch.equal(a, b)


def test_the_same_large_seed_reproduces_in_any_batch(engine):
    """A seed over 2**32 gives the same tokens alone and among other seeded and greedy jobs."""
    seed = 5 + 2**40
    alone = engine.generate([_req("big-a", temperature=1.5, seed=seed)])[0]
    mixed = engine.generate([_req("c0", temperature=1.5, seed=5), _req("c1"), _req("big-b", temperature=1.5, seed=seed),
                             _req("c2", temperature=1.5, seed=seed + 1)])  # fmt: skip
    assert alone.ok and alone.output_ids == mixed[2].output_ids and mixed[2].output_ids != mixed[0].output_ids


# ---- one batch of every extreme


GOOD = {
    "greedy": dict(), "t-1e-30": dict(temperature=1e-30, seed=1), "t-5": dict(temperature=5.0, seed=1),
    "t-1e30": dict(temperature=1e30, seed=1), "p-1e-12": dict(temperature=1.0, top_p=1e-12, seed=2),
    "p-subnormal": dict(temperature=1.0, top_p=1e-320, seed=2), "k-1": dict(temperature=1.0, top_k=1, seed=2),
    "k-2**63": dict(temperature=1.0, top_k=2**63, seed=2), "seed-max": dict(temperature=1.0, seed=2**63 - 1),
    "m-1": dict(max_new_tokens=1), "stop-overlap": dict(stop=("e", "ee", "the")), "stop-long": dict(stop=("x" * 10_000,)),
    "lp-20": dict(logprobs=20, temperature=1.0, seed=3),
}
BAD = {
    "t-nan": dict(temperature=float("nan")), "t-inf": dict(temperature=float("inf")), "t-neg": dict(temperature=-1.0),
    "t-str": dict(temperature="0.5"), "p-0": dict(temperature=1.0, top_p=0.0), "p-2": dict(temperature=1.0, top_p=2.0),
    "k-neg": dict(top_k=-1), "seed-float": dict(temperature=1.0, seed=1.5), "m-0": dict(max_new_tokens=0),
    "m-huge": dict(max_new_tokens=10**9), "stop-empty": dict(stop=("",)), "stop-str": dict(stop="e"), "lp-21": dict(logprobs=21),
}


def test_a_batch_of_extremes_answers_each_job_alone(engine):
    """Every valid extreme succeeds with finite logprobs and the tokens it gets alone; every bad one fails alone with
    invalid_sampling_params or max_new_tokens_too_large, naming its value; as do a surrogate prompt and an over-long one."""
    jobs = [_req(k, **v) for k, v in {**GOOD, **BAD}.items()]
    jobs += [_req("sur", "\ud800abc"), _req("long", [5] * 65), _req("at-max", [5] * 64, max_new_tokens=1)]
    got = {r.request_id: r for r in engine.generate(jobs)}
    for name, sampling in {**GOOD, "at-max": {}}.items():
        r = got[name]
        assert r.ok and r.finish_reason in ("length", "stop"), (name, r.error)
        for e in (r.logprobs or {"content": []})["content"]:
            assert all(math.isfinite(v) for v in [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]), name
        if name in GOOD:
            assert engine.generate([_req(name + "-alone", **sampling)])[0].output_ids == r.output_ids, name
    for name, sampling in BAD.items():
        r = got[name]
        field = next(k for k in sampling if k != "temperature" or len(sampling) == 1)
        assert not r.ok and r.error.code in ("invalid_sampling_params", "max_new_tokens_too_large"), (name, r.error)
        assert field in str(r.error), (name, str(r.error))
    assert got["sur"].error.code == "invalid_request" and "surrogate" in str(got["sur"].error), got["sur"].error
    assert got["long"].error.code == "prompt_too_long"


def test_a_lone_surrogate_in_a_chat_message_fails_that_request_alone(engine):
    """A message whose content UTF-8 cannot carry is refused naming the message, not as a logged admission failure."""
    bad = GenerationRequest(request_id="m-sur", messages=({"role": "user", "content": "ok"}, {"role": "user", "content": "a\udfffb"}),
                            sampling=SamplingParams(max_new_tokens=2))  # fmt: skip
    got = engine.generate([bad, _req("m-ok", max_new_tokens=2)])
    assert got[0].error.code == "invalid_request" and "messages[1].content" in str(got[0].error), got[0].error
    assert got[1].ok


def test_a_request_id_given_twice_in_one_offline_file_names_the_field(demo_set, tmp_path):
    """`lorabatch generate` on a file repeating a request_id: the first line runs, the second fails naming request_id
    (it said `field: null`), and the line after still runs."""
    import json

    from consumer.offline import run_offline

    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("".join(json.dumps({"request_id": rid, "prompt": "hi", "max_new_tokens": 2}) + "\n" for rid in ("a", "a", "b")))
    config = EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=64, max_new_tokens=32)
    first, second, third = (json.loads(line) for line in run_offline(config, {}, jobs))
    assert first["status"] == third["status"] == "succeeded"
    assert second["status"] == "failed" and second["error"]["code"] == "duplicate_request_id"
    assert second["error"]["field"] == "request_id", second
