"""Sampling filters, seeded draws, logprobs and incremental detokenization, on small tensors and the demo tokenizer."""

from __future__ import annotations

import pytest
import torch

from engine.api import RequestError, SamplingParams
from engine.config import EngineConfig
from engine.sampling import (
    MIN_LOGPROB,
    TEMPERATURE_FLOOR,
    filtered_probs,
    generator_seed,
    is_greedy,
    openai_logprob_entry,
    sample_tokens,
    token_logprobs,
    usable_rows,
)
from engine.validation import check_sampling
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


# ---- numerical safety (engine.sampling, "Numerical safety")

_ROW = torch.randn(64, generator=torch.Generator().manual_seed(11)) * 3  # [V]


def _poisoned(kind: str) -> torch.Tensor:
    row = _ROW.clone()
    if kind == "nan":
        row[3] = float("nan")
    elif kind == "all nan":
        row[:] = float("nan")
    elif kind == "+inf":
        row[5] = float("inf")
    elif kind == "all -inf":
        row[:] = float("-inf")
    elif kind == "some -inf":
        row[10:] = float("-inf")
    elif kind == "huge":
        row = row * 1e37
    return row


_EXTREME = [
    SamplingParams(temperature=2e-5),  # just above TEMPERATURE_FLOOR
    SamplingParams(temperature=5.0),
    SamplingParams(temperature=1e6),
    SamplingParams(temperature=1.0, top_p=1e-300),
    SamplingParams(temperature=1.0, top_p=5e-324),
    SamplingParams(temperature=1.0, top_k=10**12),
    SamplingParams(temperature=0.5, top_k=1, top_p=1e-300),
    SamplingParams(temperature=3.0, top_k=64, top_p=0.999999),
]


@pytest.mark.parametrize("kind", ["clean", "nan", "all nan", "+inf", "all -inf", "some -inf", "huge"])
@pytest.mark.parametrize("params", _EXTREME, ids=lambda p: f"T={p.temperature},p={p.top_p},k={p.top_k}")
def test_filtered_probs_are_always_a_finite_distribution(params, kind):
    """Whatever the parameters the contract allows and whatever the logits (NaN, inf, nothing finite, 1e37), the
    probabilities handed to torch.multinomial are finite, >= 0 and sum to 1, and a draw succeeds."""
    probs = filtered_probs(_poisoned(kind), params)
    assert torch.isfinite(probs).all() and (probs >= 0).all(), probs
    assert torch.isclose(probs.sum(), torch.tensor(1.0), atol=1e-5), probs.sum()
    torch.multinomial(probs, 1, generator=_gen(0))


@pytest.mark.parametrize(
    ("kind", "usable"),
    [("clean", True), ("some -inf", True), ("huge", True), ("nan", False), ("all nan", False), ("+inf", False), ("all -inf", False)],
)
def test_usable_rows_flags_rows_that_cannot_be_sampled(kind, usable):
    """A row is usable iff it has no NaN, no +inf and at least one finite logit; other rows are judged on their own."""
    logits = torch.stack([_poisoned("clean"), _poisoned(kind)])
    assert usable_rows(logits).tolist() == [True, usable]
    tokens = sample_tokens(logits, [SamplingParams(temperature=1.0), SamplingParams()], [_gen(0), None])
    assert all(0 <= t < logits.shape[1] for t in tokens)


def test_usable_rows_judges_mixed_poison_row_by_row():
    """Rows mixing NaN, +inf and -inf anywhere in the row (first, last, alone among -inf) are unusable; a row with one
    finite logit among -inf is usable; each judged on its own within one batch, as the decode chains call it."""
    inf, nan = float("inf"), float("nan")
    rows = torch.full((7, 50), -inf)
    rows[0, 49] = 0.5  # one finite logit at the end
    rows[1, 0], rows[1, 1] = nan, inf
    rows[2, 49] = nan  # NaN alone among -inf
    rows[3] = torch.randn(50)
    rows[3, 0] = inf  # +inf first, the rest finite
    rows[4] = torch.randn(50)
    rows[4, 49] = nan  # NaN last, the rest finite
    rows[5] = torch.finfo(torch.float32).max  # huge but finite
    assert usable_rows(rows).tolist() == [True, False, False, False, False, True, False]


@pytest.mark.parametrize("temperature", [0.0, 1e-300, 1e-6, TEMPERATURE_FLOOR])
def test_a_temperature_at_or_below_the_floor_is_greedy(temperature):
    """Temperatures up to TEMPERATURE_FLOOR take the argmax and need no generator."""
    p = SamplingParams(temperature=temperature)
    assert is_greedy(p)
    assert sample_tokens(_ROW[None], [p], [None]) == [int(_ROW.argmax())]


@pytest.mark.parametrize(
    ("seed", "folded"),
    [(0, 0), (1, 1), (2**63 - 1, 2**63 - 1), (2**64 - 1, 2**64 - 1), (2**64, 0), (-1, 2**64 - 1), (-(2**63), 2**63), (2**200 + 5, 5)],
)
def test_seeds_fold_into_manual_seeds_range(seed, folded):
    """generator_seed is the identity on the contract's [0, 2**63 - 1] and maps every other int into [0, 2**64)."""
    assert generator_seed(seed) == folded
    torch.Generator().manual_seed(generator_seed(seed))


def test_logprobs_of_masked_tokens_are_json_safe():
    """A token of probability 0 (logit -inf) is reported as MIN_LOGPROB, never -inf."""
    row = _poisoned("some -inf")[None]
    lp = token_logprobs(row, [int(row.argmax())], [20])[0]
    assert all(v >= MIN_LOGPROB for _, v in lp.top) and MIN_LOGPROB in [v for _, v in lp.top]


def test_token_bytes_of_an_id_past_the_vocabulary_is_empty(demo_set):
    """Ids the tokenizer does not know (a padded model vocabulary) stand for no bytes and decode to nothing."""
    tok = Tokenizer(demo_set["model"])
    v = tok.vocab_size
    assert tok.token_bytes(v) == b"" and tok.token_bytes(v + 63) == b""
    assert tok.decode([v, v + 1]) == ""
    entry = openai_logprob_entry(token_logprobs(torch.zeros(1, v + 64), [v + 1], [2])[0], tok.token_bytes)
    assert entry["token"] == "" and entry["bytes"] == []


@pytest.mark.parametrize(
    ("field", "value", "ok"),
    [
        ("temperature", 1e-300, True), ("temperature", 5.0, True), ("temperature", float("inf"), False),
        ("temperature", float("nan"), False), ("temperature", 10**400, False), ("temperature", True, False),
        ("top_p", 1e-300, True), ("top_p", 1, True), ("top_p", float("nan"), False), ("top_p", float("inf"), False),
        ("top_p", "0.5", False), ("top_p", 0.0, False), ("top_p", 1.0000001, False),
        ("top_k", 10**12, True), ("top_k", 0, True), ("top_k", -1, False), ("top_k", True, False), ("top_k", 2.0, False),
        ("seed", 0, True), ("seed", 2**63 - 1, True), ("seed", 2**80, True), ("seed", 1.5, False), ("seed", False, False),
        ("logprobs", 20, True), ("logprobs", True, False),
    ],
)  # fmt: skip
def test_check_sampling_refuses_non_finite_and_mistyped_params(field, value, ok):
    """check_sampling lets through exactly what the sampler handles, and refuses NaN/inf, wrong types and out-of-range
    values with invalid_sampling_params naming the field."""
    sp = SamplingParams(max_new_tokens=4, **{field: value})
    if ok:
        check_sampling(sp, EngineConfig(model_dir="unused"))
    else:
        with pytest.raises(RequestError) as err:
            check_sampling(sp, EngineConfig(model_dir="unused"))
        assert err.value.code == "invalid_sampling_params" and field in str(err.value)


def test_incremental_detokenizer_work_stays_linear_on_bytes_that_never_form_text(demo_set):
    """Tokens whose text ends in U+FFFD for ever (a lone UTF-8 continuation byte, repeated: a job's input_ids can show
    the model a run of them, and models repeat what they are shown) were held back whole as a character in the making,
    each push decoding all of them again: 8,192 such tokens of a job with stop strings took 2.6 s of the engine's
    thread, 32,768 about 40 s. A character is at most 4 bytes, so past a few tokens what is held is text, U+FFFD and all."""
    tok = Tokenizer(demo_set["model"])
    lone = next(i for i in range(tok.vocab_size) if tok.token_bytes(i) == b"\x80")
    decoded = [0]
    plain = tok.decode

    def counting(ids, **kw):
        decoded[0] += len(ids)
        return plain(ids, **kw)

    tok.decode = counting
    detok = IncrementalDetokenizer(tok)
    n = 2_000
    for _ in range(n):
        detok.push(lone)
    assert decoded[0] <= 50 * n, decoded[0]  # held back whole: n * n tokens decoded
    assert plain([lone] * n).startswith(detok.text) and len(detok.text) >= n - 9  # what is still held is a few tokens


@pytest.mark.parametrize("run", range(14))
def test_incremental_detokenizer_gives_a_character_that_completes_after_the_hold_cap(demo_set, run):
    """After `run` lone continuation bytes (text that never completes: held at most _MAX_HELD tokens), a 4-byte
    character sent a byte a token and then "a": the incremental text is the text of all the tokens, wherever the cap
    falls inside the character. Given out as U+FFFD when the cap fell on its first byte, the character itself was never
    given (the window's text kept its length), so a stop string holding it never matched."""
    tok = Tokenizer(demo_set["model"])
    byte = {tok.token_bytes(i): i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1}
    ids = [byte[b"\x80"]] * run + [byte[bytes([b])] for b in "😀a".encode()]
    detok = IncrementalDetokenizer(tok)
    given = "".join(detok.push(i) for i in ids)
    assert given == detok.text == tok.decode(ids), (given, tok.decode(ids))
