"""A model vocabulary padded past the tokenizer's (a model's vocab rounded up to a multiple): ids in the padding may be
chosen and listed in logprobs, and decode to nothing."""

from __future__ import annotations

import pytest

from engine.demo_model import write_demo_model
from engine.engine import Engine
from tests.test_serving_helpers import config, patch_forward, req


@pytest.fixture(scope="module")
def padded(tmp_path_factory):
    model = tmp_path_factory.mktemp("padded") / "model"
    write_demo_model(model, seed=0, vocab_multiple=128)
    e = Engine(config({"model": model}, enable_prefix_caching=False))
    assert e.runner.config.vocab_size > e.tokenizer.vocab_size, (e.runner.config.vocab_size, e.tokenizer.vocab_size)
    return e


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_token_ids_past_the_tokenizer_give_logprobs_and_decode(padded, monkeypatch, temperature):
    """Ids in [tokenizer vocab, model vocab) (padding) may be chosen and listed in top_logprobs: each gets an entry with
    token "" and bytes [], and the text decodes (without them)."""
    pad_ids = list(range(padded.tokenizer.vocab_size, padded.runner.config.vocab_size))

    def edit(items, logits):
        top = logits.max()
        logits[:, pad_ids[0]] = top + 5.0  # the padding id wins
        logits[:, pad_ids[-1]] = top + 4.0  # and another one is second

    patch_forward(monkeypatch, padded, edit)
    res = padded.generate([req("p", max_new_tokens=4, logprobs=5, temperature=temperature, seed=1),
                           req("q", input_ids=(3, 4, pad_ids[2], 5), max_new_tokens=2)])  # fmt: skip
    assert all(r.ok for r in res), [r.error for r in res]
    content = res[0].logprobs["content"]
    assert len(content) == 4 and pad_ids[0] in res[0].output_ids
    for token, entry in zip(res[0].output_ids, content):
        if token in pad_ids:
            assert entry["token"] == "" and entry["bytes"] == [], entry
        padding = [e for e in entry["top_logprobs"] if e["bytes"] == [] and e["token"] == ""]
        assert len(padding) >= 2 and entry["top_logprobs"][1] in padding, entry  # the two boosted padding ids lead
    if temperature == 0.0:
        assert res[0].output_ids == [pad_ids[0]] * 4 and res[0].text == ""
    assert padded.tokenizer.decode(res[0].output_ids) == res[0].text
