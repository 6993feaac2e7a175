"""A prompt certainly over engine.max_prompt_tokens is refused before it is encoded (engine.validation's
check_text_bound, engine.tokenizer's max_token_bytes); one that may fit is encoded and judged by its real count."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumer.outcomes import engine_error_field
from consumer.schemas import Job
from engine.api import GenerationRequest, RequestError, SamplingParams
from engine.config import EngineConfig
from engine.engine import Engine
from engine.tokenizer import Tokenizer, max_token_bytes
from engine.validation import prompt_ids

LIMIT = 64
SP = SamplingParams(max_new_tokens=8)


@pytest.fixture(scope="module")
def tok(demo_set) -> Tokenizer:
    return Tokenizer(demo_set["model"])


@pytest.fixture(scope="module")
def config(demo_set) -> EngineConfig:
    return EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_prompt_tokens=LIMIT, max_new_tokens=32,
                        max_batch_size=4, kv_block_size=8)  # fmt: skip


class Spy:
    """Counts the tokenizer's encode calls (the call a refusal must not make)."""

    def __init__(self, tok: Tokenizer, monkeypatch: pytest.MonkeyPatch):
        self.calls = 0
        real = tok.encode

        def encode(text, **kw):
            self.calls += 1
            return real(text, **kw)

        monkeypatch.setattr(tok, "encode", encode)


def _ids(req_kw: dict, tok: Tokenizer, config: EngineConfig) -> list[int]:
    return prompt_ids(GenerationRequest(request_id="r", sampling=SP, **req_kw), tok, config, vocab_size=tok.vocab_size)


def test_demo_tokenizer_bound_is_its_longest_token_in_bytes(tok):
    """L is the longest token's byte length (byte-level chars counted as the one byte each stands for)."""
    longest = max(len(tok.token_bytes(i)) for i in range(tok.vocab_size))
    assert tok.max_token_bytes == longest == 10  # " assistant"


@pytest.mark.parametrize("kw", [dict(prompt="x" * 3_000_000), dict(prompt="日本語" * 400_000),
                                dict(messages=[{"role": "system", "content": "hi"}, {"role": "user", "content": "y" * 3_000_000}])])
def test_a_prompt_of_megabytes_is_refused_without_encoding(tok, config, monkeypatch, kw):
    """A few-MB prompt or chat fails with prompt_too_long naming engine.max_prompt_tokens; encode never runs."""
    spy = Spy(tok, monkeypatch)
    with pytest.raises(RequestError) as e:
        _ids(kw, tok, config)
    assert spy.calls == 0
    assert e.value.code == "prompt_too_long"
    assert f"over engine.max_prompt_tokens={LIMIT}; shorten it" in str(e.value)
    field = "prompt" if "prompt" in kw else "messages"
    job = Job.model_validate({"request_id": "r", "tenant_id": "t", **kw})
    assert engine_error_field(e.value.code, str(e.value), job) == field


def test_at_the_bound_a_prompt_is_encoded_and_judged_by_its_real_count(tok, config, monkeypatch):
    """B = LIMIT * L bytes is not certainly over: encoded, and refused by its real count; one byte more is refused
    unencoded; (LIMIT - 1) * L bytes of L-byte tokens fit (BOS makes LIMIT) and run."""
    spy = Spy(tok, monkeypatch)
    per = tok.max_token_bytes
    with pytest.raises(RequestError, match=r"^prompt is \d+ tokens, over") as e:
        _ids(dict(prompt="x" * (LIMIT * per)), tok, config)
    assert e.value.code == "prompt_too_long" and spy.calls == 1
    with pytest.raises(RequestError, match="^prompt is at least 65 tokens"):
        _ids(dict(prompt="x" * (LIMIT * per + 1)), tok, config)
    assert spy.calls == 1
    fits = " assistant" * (LIMIT - 1)
    assert len(fits.encode()) == (LIMIT - 1) * per
    assert len(_ids(dict(prompt=fits), tok, config)) == LIMIT and spy.calls == 2


def test_chat_at_the_bound_is_encoded_and_judged_by_its_real_count(tok, config, monkeypatch):
    """The bound is taken on the rendered chat (the template's own text counts too, whatever it does with contents):
    a chat whose render is over it is refused unencoded; one just under is encoded and refused by its real count."""
    spy = Spy(tok, monkeypatch)
    per = tok.max_token_bytes
    frame = len(tok.apply_chat_template([{"role": "user", "content": ""}]).encode())
    over = [{"role": "user", "content": "z" * (LIMIT * per - frame + 1)}]
    with pytest.raises(RequestError, match="^messages render to at least 65 tokens"):
        _ids(dict(messages=over), tok, config)
    assert spy.calls == 0
    at = [{"role": "user", "content": "z" * (LIMIT * per - frame)}]
    with pytest.raises(RequestError, match=r"^prompt is \d+ tokens, over"):
        _ids(dict(messages=at), tok, config)
    assert spy.calls == 1
    short = ({"role": "user", "content": "What is soup?"},)
    assert _ids(dict(messages=short), tok, config) == tok.encode_chat(short)


def test_the_engine_refuses_a_huge_prompt_alone_without_encoding_it(demo_set, config, monkeypatch):
    """Through the engine's admission: the huge request fails with prompt_too_long, its neighbour runs."""
    engine = Engine(config)
    spy = Spy(engine.tokenizer, monkeypatch)
    huge = GenerationRequest(request_id="huge", prompt="w " * 2_000_000, sampling=SP)
    ok = GenerationRequest(request_id="ok", prompt="The river runs through", sampling=SP)
    by_id = {r.request_id: r for r in engine.generate([huge, ok])}
    assert by_id["huge"].error.code == "prompt_too_long" and "engine.max_prompt_tokens" in by_id["huge"].error.message
    assert by_id["ok"].ok and spy.calls == 1  # the neighbour's


_PIECES = ["<s>", "</s>", " assistant", "\u0120", "é", "日本", "\U0001f600", " ", "\n", "\x00"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(max_size=40), st.sampled_from(_PIECES)), max_size=30).map("".join))
def test_the_lower_bound_never_exceeds_the_real_count(demo_set, text):
    """ceil(bytes / L) <= tokens, for any text (multibyte, special-token strings, control characters), prompt or chat."""
    tok = _demo_tok(demo_set)
    per = tok.max_token_bytes
    assert -(-len(text.encode()) // per) <= len(tok.encode(text, add_special_tokens=False))
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    assert -(-len(chat.encode()) // per) <= len(tok.encode(chat, add_special_tokens=False))


_TOKS: dict = {}


def _demo_tok(demo_set) -> Tokenizer:  # hypothesis refuses function-scoped fixtures; the module one is built once here
    return _TOKS.setdefault("demo", Tokenizer(demo_set["model"]))


def _spec(**kw) -> dict:
    alphabet = [chr(c) for c in range(33, 127)]  # enough for the shapes below; the byte-level ones add the rest
    base = {"model": {"type": "BPE", "vocab": {c: i for i, c in enumerate(alphabet)}, "byte_fallback": False},
            "normalizer": None, "pre_tokenizer": None, "truncation": None, "added_tokens": []}
    return {**base, **kw}


def _byte_level(extra: dict | None = None, **kw) -> dict:
    from engine.tokenizer import _byte_level_decoder

    vocab = {c: i for i, c in enumerate(_byte_level_decoder())}
    vocab.update({"\u0120the": len(vocab), "\u00e6\u0139\u00a5": len(vocab) + 1, **(extra or {})})  # " the", "日"
    return _spec(**{"model": {"type": "BPE", "vocab": vocab}, "pre_tokenizer": {"type": "ByteLevel"}, **kw})


def _sentencepiece(**kw) -> dict:
    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"\u2581the": 256, "\u2581\u2581\u2581": 257})
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    return _spec(model={"type": "BPE", "vocab": vocab, "byte_fallback": True},
                 normalizer={"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, replace]}, **kw)


@pytest.mark.parametrize("spec, want", [
    (_byte_level(), 4),  # " the" is 4 bytes; "日" 3
    (_byte_level(added_tokens=[{"id": 999, "content": "<|endoftext|>"}]), 13),
    (_byte_level(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Isolated"}, {"type": "ByteLevel"}]}), 4),
    (_sentencepiece(), 9),  # "▁▁▁" as written: 3 literal U+2581 are 9 bytes of input; <0xXX> is 1
    (_spec(), None),  # no byte alphabet, no byte fallback: unknown text becomes <unk>
    (_byte_level(pre_tokenizer={"type": "WhitespaceSplit"}), None),  # drops spaces
    (_byte_level(pre_tokenizer={"type": "Sequence", "pretokenizers": [
        {"type": "Split", "behavior": "Removed"}, {"type": "ByteLevel"}]}), None),
    (_byte_level(normalizer={"type": "NFC"}), None),  # composes: 9 bytes of jamo are one 3-byte syllable
    (_byte_level(normalizer={"type": "Lowercase"}), None),
    (_byte_level(added_tokens=[{"id": 999, "content": "<mask>", "lstrip": True}]), None),
    (_byte_level(truncation={"max_length": 8}), None),
    ({**_byte_level(), "model": {**_byte_level()["model"], "type": "WordLevel"}}, None),
    ({**_byte_level(), "model": {"type": "BPE", "vocab": {"a": 0}}}, None),  # alphabet incomplete
])
def test_max_token_bytes_holds_only_where_no_text_is_lost(spec, want):
    """The bound is given for lossless BPE shapes only; anything that may drop, merge or shorten text has none."""
    assert max_token_bytes(json.loads(json.dumps(spec))) == want


def test_a_tokenizer_without_a_bound_encodes_everything(tok, config, monkeypatch):
    """No bound: the old path, the prompt encoded and refused by its real count."""
    spy = Spy(tok, monkeypatch)
    monkeypatch.setattr(tok, "max_token_bytes", None)
    with pytest.raises(RequestError, match=r"^prompt is \d+ tokens, over"):
        _ids(dict(prompt="x" * 10_000), tok, config)
    assert spy.calls == 1
