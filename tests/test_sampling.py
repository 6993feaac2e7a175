"""Sampling filters, seeded draws, logprobs and incremental detokenization, on small tensors and the demo tokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.api import SamplingParams
from engine.sampling import filtered_probs, openai_logprob_entry, sample_tokens, token_logprobs
from engine.tokenizer import IncrementalDetokenizer, Tokenizer


def _logits(rows: int = 4, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2  # [M, V]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _nucleus(row: torch.Tensor, top_p: float) -> set[int]:
    """The most likely tokens up to and including the one whose cumulative probability reaches top_p."""
    probs, order = row.softmax(-1).sort(descending=True)
    n = int((probs.cumsum(0) < top_p).sum()) + 1
    return set(order[:n].tolist())


def test_greedy_is_argmax_of_each_row():
    """temperature 0 picks each row's argmax, whatever the other rows do."""
    logits = _logits()
    assert sample_tokens(logits, [SamplingParams()] * 4, [None] * 4) == logits.argmax(-1).tolist()


def test_greedy_breaks_ties_to_the_first_index():
    """Equal maxima resolve to the lowest token id, as torch/HF argmax does."""
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert sample_tokens(logits, [SamplingParams()], [None]) == [1]


@pytest.mark.parametrize("temperature", [0.3, 1.0, 5.0])
def test_top_k_1_equals_greedy(temperature):
    """top_k=1 leaves one candidate, so sampling at any temperature returns the argmax."""
    logits = _logits(rows=8)
    p = SamplingParams(temperature=temperature, top_k=1)
    assert sample_tokens(logits, [p] * 8, [_gen(i) for i in range(8)]) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        (SamplingParams(temperature=1.0, top_k=3), lambda row: set(row.topk(3).indices.tolist())),
        (SamplingParams(temperature=1.0, top_p=1e-6), lambda row: {int(row.argmax())}),
        (SamplingParams(temperature=1.0, top_p=0.5), lambda row: _nucleus(row, 0.5)),
    ],
    ids=["top_k=3", "top_p tiny", "top_p=0.5"],
)
def test_filters_keep_draws_inside_their_set(params, allowed):
    """Over many draws, top-k and top-p only ever yield tokens of the kept set."""
    row = _logits(rows=1, vocab=30, seed=5)[0]
    keep = allowed(row)
    g = _gen(0)
    draws = {sample_tokens(row[None], [params], [g])[0] for _ in range(300)}
    assert draws <= keep, (draws - keep, keep)
    assert len(keep) == 1 or len(draws) > 1, "the draws never varied: the generator is not used"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.9),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.8),
    ],
)
def test_filtered_probs_are_a_distribution_matching_the_scaled_softmax(params):
    """After the filters the probabilities sum to 1 and, on the kept tokens, are proportional to softmax(logits / T)."""
    row = _logits(rows=1, vocab=40, seed=3)[0]
    probs = filtered_probs(row, params)
    assert torch.isclose(probs.sum(), torch.tensor(1.0), atol=1e-6)
    kept = probs > 0
    ref = torch.softmax(row / params.temperature, -1)[kept]
    assert torch.allclose(probs[kept], ref / ref.sum(), atol=1e-6)
    if params.top_k:
        assert int(kept.sum()) <= params.top_k


def test_same_seed_same_draws_different_seed_different_draws():
    """A generator seeded alike reproduces its draws; another seed gives another sequence."""
    row = _logits(rows=1, vocab=100, seed=9)
    p = SamplingParams(temperature=1.5)

    def draws(seed: int) -> list[int]:
        g = _gen(seed)
        return [sample_tokens(row, [p], [g])[0] for _ in range(20)]

    assert draws(42) == draws(42)
    assert draws(42) != draws(43)


def test_a_rows_draw_does_not_depend_on_its_batch_companions():
    """Row 0's sampled token is the same alone and beside other sampled and greedy rows."""
    logits = _logits(rows=4, vocab=60, seed=11)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = sample_tokens(logits[:1], [p], [_gen(7)])
    mixed = sample_tokens(
        logits[[1, 0, 2, 3]],
        [SamplingParams(temperature=2.0), p, SamplingParams(), SamplingParams(temperature=0.5)],
        [_gen(1), _gen(7), None, _gen(2)],
    )
    assert mixed[1] == alone[0]


@pytest.mark.parametrize("top_n", [0, 1, 5])
def test_logprobs_are_log_softmax_of_raw_logits(top_n):
    """The chosen token's logprob and the top_n list come from log_softmax of the raw logits, most likely first."""
    logits = _logits(rows=3, vocab=40)
    chosen = [3, 7, 11]
    out = token_logprobs(logits, chosen, [top_n] * 3)
    logp = torch.log_softmax(logits, -1)
    for row, lp in enumerate(out):
        assert lp.token_id == chosen[row]
        assert lp.logprob == pytest.approx(float(logp[row, chosen[row]]), abs=1e-6)
        assert len(lp.top) == top_n
        assert [t for t, _ in lp.top] == logp[row].topk(top_n).indices.tolist()
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:]))


def test_logprobs_top_n_may_differ_per_row():
    """Rows asking for different top_n each get their own count."""
    out = token_logprobs(_logits(rows=2), [0, 1], [2, 0])
    assert [len(lp.top) for lp in out] == [2, 0]


def test_openai_entry_shape(demo_set):
    """An entry has token, logprob, bytes and top_logprobs with the same three keys, bytes being the token's raw bytes."""
    tok = Tokenizer(demo_set["model"])
    ids = tok.encode("café", add_special_tokens=False)
    lp = token_logprobs(_logits(rows=1, vocab=tok.vocab_size), [ids[-1]], [2])[0]
    entry = openai_logprob_entry(lp, tok.token_bytes)
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert bytes(entry["bytes"]) == tok.token_bytes(ids[-1])
    assert len(entry["top_logprobs"]) == 2
    assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])


@pytest.mark.parametrize(
    "text",
    ["plain words and spaces", "café ☕ 日本語 🚀 done", "  two leading spaces", "\nnew\nlines\n", ""],
    ids=["ascii", "multibyte", "leading-spaces", "newlines", "empty"],
)
def test_incremental_detokenizer_rebuilds_the_full_decode(demo_set, text):
    """Pushing tokens one at a time yields exactly decode(all ids), never a partial UTF-8 character."""
    tok = Tokenizer(demo_set["model"])
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)
