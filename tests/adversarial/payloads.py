"""Hostile job payloads: hypothesis strategies drawn into one batch, and a table of fixed edge cases.

Each case says what a correct worker must make of it:
- "dlq": one DLQ record (the message cannot be answered: no readable identity), no result;
- "succeeded" / "failed": one result with that status (a failed one with one of `codes`), no DLQ record;
- "result": one result, either status, never `engine_error` (a failed one with one of `codes` if given);
- "one": exactly one outcome, a DLQ record or a failed result (the identity is readable only textually).
Answerable cases of a registered tenant must also have exactly one ledger row of their result's status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.adversarial.harness import Message

TENANTS = ("acme", "globex")  # registered, each with a default adapter
UNKNOWN_TENANT = "ghost"
DEMO_VOCAB = 575  # the demo model's vocabulary (engine.demo_model); tests pass the model's own (model_vocab)
ENGINE_MAX_NEW_TOKENS = 32  # the suite's engine.max_new_tokens
MAX_SEED = 2**63 - 1
INVALID = frozenset({"invalid_job"})
TOO_MANY_TOKENS = frozenset({"max_new_tokens_too_large", "invalid_job"})
SAMPLING = frozenset({"invalid_job", "invalid_sampling_params"})


@dataclass(frozen=True)
class Case:
    message: Message
    want: str  # "dlq" | "succeeded" | "failed" | "result" | "one"
    codes: frozenset[str] | None = None


def draw(strategy: st.SearchStrategy, n: int) -> list:
    """`n` examples of `strategy`, drawn by hypothesis (derandomized: the same batch on every run).

    The examples are run as one batch against one worker, so hypothesis only generates here; it does not
    shrink (a failure names the offending payloads instead)."""
    out: list = []

    @settings(max_examples=n, database=None, derandomize=True, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example) -> None:
        out.append(example)

    collect()
    return out


# ---------------------------------------------------------------- strategies

json_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**300), max_value=10**300)
                | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=30))
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=25)

# Text that tokenizes well within engine.max_prompt_tokens=200 (byte-level: at most 4 tokens a character),
# through every plane, with the characters that break naive code mixed in.
SPECIAL_CHARS = "\x00\u202e\u200f\u202a\ufeff\u0301\U0001f600\u2028\u2029\x7f\t\n\r\"\\/<>"
safe_text = st.text(st.characters(exclude_categories=("Cs",)) | st.sampled_from(SPECIAL_CHARS), min_size=1, max_size=30)


def model_vocab(model_dir) -> int:
    """The vocabulary size the engine checks input_ids against: the model's config.json."""
    return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])


def valid_jobs(vocab: int = DEMO_VOCAB) -> st.SearchStrategy[dict]:
    """Jobs inside every limit of the contract and of the suite's engine: each must succeed."""
    prompt = st.one_of(
        st.fixed_dictionaries({"prompt": safe_text}),
        st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries({
            "role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(min_size=1, max_size=8)}), min_size=1, max_size=2)}),
        st.fixed_dictionaries({"input_ids": st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40)}),
    )
    optional = {
        "temperature": st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 5.0]) | st.floats(0.0, 5.0),
        "top_p": st.sampled_from([1.0, 5e-324, 1e-300, 0.5]) | st.floats(0.0, 1.0, exclude_min=True),
        "top_k": st.sampled_from([0, 1, vocab - 1, vocab, vocab + 1, 1_000_000]) | st.integers(0, 1_000_000),
        "seed": st.sampled_from([0, 1, 2**31, 2**32, 2**63 - 1]) | st.integers(0, MAX_SEED),
        "priority": st.integers(-100, 100),
        "logprobs": st.none() | st.integers(0, 20),
        "stop": st.lists(st.text(min_size=1, max_size=64), max_size=8),
        "user_id": st.from_regex(r"\A[A-Za-z0-9_.:@/\-]{1,128}\Z"),
        "session_id": st.from_regex(r"\A[A-Za-z0-9_.:@/\-]{1,128}\Z"),
        "batch_id": st.from_regex(r"\A[A-Za-z0-9_.:@/\-]{1,128}\Z"),
    }
    return st.builds(lambda base, extra, n: {**base, **extra, "max_new_tokens": n}, prompt,
                     st.fixed_dictionaries({}, optional=optional), st.integers(1, 4))


# One field of a valid job replaced by a value outside its contract; (field, value, codes).
_not_number = st.lists(st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2) | st.just("abc")
bad_fields = st.one_of(
    st.tuples(st.just("temperature"), st.floats(min_value=5.0, exclude_min=True) | st.floats(max_value=-1e-300) | _not_number, st.just(INVALID)),
    st.tuples(st.just("top_p"), st.floats(min_value=1.0, exclude_min=True) | st.floats(max_value=0.0).filter(lambda x: x <= 0) | _not_number, st.just(INVALID)),
    st.tuples(st.just("top_k"), st.integers(max_value=-1) | _not_number, st.just(INVALID)),
    st.tuples(st.just("priority"), st.integers(min_value=101) | st.integers(max_value=-101) | _not_number, st.just(INVALID)),
    st.tuples(st.just("logprobs"), st.integers(min_value=21) | st.integers(max_value=-1) | _not_number, st.just(INVALID)),
    st.tuples(st.just("max_new_tokens"), st.integers(max_value=0) | _not_number, st.just(INVALID)),
    st.tuples(st.just("max_new_tokens"), st.integers(ENGINE_MAX_NEW_TOKENS + 1, 10**6), st.just(TOO_MANY_TOKENS)),
    st.tuples(st.just("stop"), st.lists(st.text(min_size=1, max_size=4), min_size=9, max_size=12) | st.just([""]) | st.just(["x" * 65]), st.just(INVALID)),
    st.tuples(st.just("messages"), st.just([{"role": "robot", "content": "hi"}]) | st.just([]) | st.just([{"role": "user"}]), st.just(INVALID)),
    st.tuples(st.just("adapter"), st.just("no such adapter!") | st.just(""), st.just(INVALID)),
    st.tuples(st.just("on_quota"), st.text(max_size=5).filter(lambda s: s not in ("wait", "fail")), st.just(INVALID)),
    st.tuples(st.text(min_size=1, max_size=12).filter(lambda s: s not in _JOB_FIELDS), json_scalars, st.just(INVALID)),
)
_JOB_FIELDS = {"v", "request_id", "tenant_id", "batch_id", "adapter", "user_id", "session_id", "prompt", "messages",
               "input_ids", "max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "priority",
               "allow_base_fallback", "on_quota", "logprobs"}


def encode(value, how: str) -> bytes:
    """A JSON value as bytes: ASCII-escaped, raw UTF-8 (lone surrogates as invalid UTF-8), or UTF-16."""
    if how == "ascii":
        return json.dumps(value, allow_nan=True).encode()
    text = json.dumps(value, allow_nan=True, ensure_ascii=False)
    if how == "utf8":
        return text.encode("utf-8", "surrogatepass")
    return text.encode("utf-16", "surrogatepass")


# ---------------------------------------------------------------- the batch


def _job(i: int, tenant: str = "acme", **fields) -> dict:
    return {"request_id": f"fz-{i}", "tenant_id": tenant, **({"prompt": "hello"} if not ({"prompt", "messages", "input_ids"} & fields.keys()) else {}),
            "max_new_tokens": 2, **fields}


def boundary_cases(start: int, vocab: int = DEMO_VOCAB) -> list[Case]:
    """Each numeric field at its limits (valid: succeeds) and just beyond them (fails with a named code)."""
    table: list[tuple[dict, str, frozenset | None]] = [
        ({"temperature": 0.0}, "succeeded", None), ({"temperature": -0.0}, "succeeded", None),
        ({"temperature": 5e-324}, "succeeded", None), ({"temperature": 5.0}, "succeeded", None),
        ({"temperature": 5.000000000000001}, "failed", INVALID), ({"temperature": -5e-324}, "failed", INVALID),
        ({"temperature": 1e308}, "failed", INVALID), ({"temperature": -1e308}, "failed", INVALID),
        ({"top_p": 1.0}, "succeeded", None), ({"top_p": 5e-324}, "succeeded", None), ({"top_p": 0.0}, "failed", INVALID),
        ({"top_p": -0.0}, "failed", INVALID), ({"top_p": 1.0000000000000002}, "failed", INVALID),
        ({"top_k": 0}, "succeeded", None), ({"top_k": 1}, "succeeded", None), ({"top_k": vocab}, "succeeded", None),
        ({"top_k": vocab + 1}, "succeeded", None), ({"top_k": 1_000_000}, "succeeded", None), ({"top_k": -1}, "failed", INVALID),
        ({"top_k": 2**63}, "result", SAMPLING), ({"top_k": 10**40}, "result", SAMPLING),
        ({"seed": 0}, "succeeded", None), ({"seed": 2**32}, "succeeded", None), ({"seed": MAX_SEED}, "succeeded", None),
        ({"seed": MAX_SEED + 1}, "result", SAMPLING), ({"seed": 2**64}, "result", SAMPLING), ({"seed": -1}, "result", SAMPLING),
        ({"seed": -(2**63) - 1}, "result", SAMPLING), ({"seed": 10**300}, "result", SAMPLING),
        ({"priority": -100}, "succeeded", None), ({"priority": 100}, "succeeded", None),
        ({"priority": 101}, "failed", INVALID), ({"priority": -101}, "failed", INVALID), ({"priority": 10**30}, "failed", INVALID),
        ({"max_new_tokens": 1}, "succeeded", None), ({"max_new_tokens": ENGINE_MAX_NEW_TOKENS}, "succeeded", None),
        ({"max_new_tokens": ENGINE_MAX_NEW_TOKENS + 1}, "failed", TOO_MANY_TOKENS), ({"max_new_tokens": 0}, "failed", INVALID),
        ({"max_new_tokens": -1}, "failed", INVALID), ({"max_new_tokens": 2**63}, "failed", TOO_MANY_TOKENS),
        ({"max_new_tokens": 10**30}, "failed", TOO_MANY_TOKENS),
        ({"logprobs": 0}, "succeeded", None), ({"logprobs": 20}, "succeeded", None), ({"logprobs": 21}, "failed", INVALID),
        ({"logprobs": -1}, "failed", INVALID), ({"logprobs": 10**20}, "failed", INVALID),
        ({"input_ids": [0]}, "succeeded", None), ({"input_ids": [vocab - 1]}, "succeeded", None),
        ({"input_ids": [vocab]}, "failed", frozenset({"invalid_input_ids", "invalid_job"})),
        ({"input_ids": [2**31 - 1]}, "failed", frozenset({"invalid_input_ids", "invalid_job"})),
        ({"input_ids": [2**63]}, "failed", frozenset({"invalid_input_ids", "invalid_job"})),
        ({"input_ids": [-1]}, "failed", INVALID), ({"input_ids": [1, 2, 10**40]}, "failed", frozenset({"invalid_input_ids", "invalid_job"})),
        ({"input_ids": [1] * 200}, "succeeded", None), ({"input_ids": [1] * 201}, "failed", frozenset({"prompt_too_long"})),
        ({"stop": ["x" * 64] * 8}, "succeeded", None),
    ]
    return [Case(Message(json.dumps(_job(start + n, **fields)).encode(), ("acme", f"fz-{start + n}"),
                         f"boundary {json.dumps(fields)[:60]}", key=f"fz-{start + n}".encode()), want, codes)
            for n, (fields, want, codes) in enumerate(table)]


def special_cases(start: int) -> list[Case]:
    """Values that break naive JSON handling, and identities at and beyond their limits."""
    def rid(n: int) -> str:
        return f"fz-{start + n}"

    unanswerable = [
        b"", None, b"null", b"true", b"0", b'"a string"', b"[]", b"{}", b"NaN", b"Infinity", b"-Infinity", b"1e308",
        b"-0.0", b"5e-324", b"1e400", b"9" * 5000, b"-" + b"9" * 5000, b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"[" * 100_000, b"\xff\xfe\xfd", b"\xc3\x28", b"\xed\xa0\x80",
        b"\xef\xbb\xbf{", b"\x00" * 64, b'{"request_id": "\\ud800", "tenant_id": "acme", "prompt": "x"}',
        b'{"request_id": "ok", "tenant_id": "acme\\u0000", "prompt": "x"}', b'{"request_id": "ok", "tenant_id": "", "prompt": "x"}',
        json.dumps({"request_id": "x" * 129, "tenant_id": "acme", "prompt": "x"}).encode(),
        json.dumps({"request_id": 12345, "tenant_id": "acme", "prompt": "x"}).encode(),
        json.dumps({"request_id": ["a"], "tenant_id": "acme", "prompt": "x"}).encode(),
        json.dumps({"request_id": "ok", "tenant_id": "t" * 65, "prompt": "x"}).encode(),
        json.dumps([{"request_id": "in-a-list", "tenant_id": "acme", "prompt": "x"}]).encode(),
        b'{"request_id": "two-tenants", "tenant_id": "globex", "tenant_id": "acme", "prompt": "x"}',  # whose job is it?
    ]
    cases = [Case(Message(v, None, f"special {v[:24]!r}" if v is not None else "special null value"), "dlq") for v in unanswerable]
    n = 0

    def add(job: dict, want: str, codes=None, *, raw: bytes | None = None, label: str = "") -> None:
        nonlocal n
        job = {**job, "request_id": rid(n)}
        cases.append(Case(Message(raw if raw is not None else json.dumps(job).encode(), (job["tenant_id"], job["request_id"]),
                                  label or f"special {json.dumps(job)[:60]}", key=job["request_id"].encode()), want, codes))
        n += 1

    base = {"tenant_id": "acme", "max_new_tokens": 2}
    # Readable identities whose JSON cannot be decoded whole: a DLQ record or a failed result, once.
    for tail in (b'"seed": ' + b"9" * 5000, b'"prompt": "x", "seed": ' + b"1" * 4301, b'"input_ids": ' + b"[" * 100_000 + b"]" * 100_000,
                 b'"prompt": "x", "extra": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000):
        raw = b'{"request_id": "' + rid(n).encode() + b'", "tenant_id": "acme", "max_new_tokens": 2, ' + tail + b"}"
        add(base, "one", raw=raw, label=f"special undecodable tail {tail[:20]!r}")
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
        for fld in ("temperature", "top_p", "max_new_tokens", "seed"):
            raw = b'{"request_id": "' + rid(n).encode() + b'", "tenant_id": "acme", "prompt": "x", "max_new_tokens": 2, "' + fld.encode() + b'": ' + literal + b"}"
            raw = raw.replace(b'"max_new_tokens": 2, "max_new_tokens"', b'"max_new_tokens"')
            add(base, "failed", INVALID, raw=raw, label=f"special {fld}={literal.decode()}")
    add({**base, "prompt": "\x00"}, "succeeded")
    add({**base, "prompt": "\u202e\u05e9\u05dc\u05d5\u05dd \u0645\u0631\u062d\u0628\u0627\u202c"}, "succeeded")
    add({**base, "prompt": "\U0001f600" * 20}, "succeeded")
    add({**base, "prompt": "a\u0301" * 30}, "succeeded")
    add({**base, "messages": [{"role": "user", "content": "\x00\u202e"}]}, "succeeded")
    add({**base, "messages": [{"role": "user", "content": ""}]}, "result")
    add({**base, "prompt": "x", "stop": ["\x00", "\u202e", "\U0001f600"]}, "succeeded")
    add({**base, "prompt": "\ud800"}, "result")  # a lone surrogate, ASCII-escaped: valid JSON, not valid text
    add({**base, "prompt": "ok \udfff ok"}, "result")
    add({**base, "messages": [{"role": "user", "content": "\udc80"}]}, "result")
    add({**base, "prompt": "x", "stop": ["\ud83d"]}, "result")
    add({**base, "prompt": "x", "user_id": "u" * 128, "session_id": "s" * 128, "batch_id": "b" * 128}, "succeeded")
    add({**base, "prompt": "x", "user_id": "u" * 129}, "failed", INVALID)
    add({**base, "prompt": ""}, "failed", INVALID)
    add({**base, "prompt": "x", "input_ids": [1]}, "failed", INVALID)
    add({**base, "prompt": "x", "v": 1}, "succeeded")
    add({**base, "prompt": "x", "v": 2}, "one")
    add({**base, "prompt": "x", "allow_base_fallback": [1]}, "failed", INVALID)
    raw = b'{"request_id": "' + rid(n).encode() + b'", "tenant_id": "acme", "prompt": "x", "max_new_tokens": 9999, "max_new_tokens": 2}'
    add(base, "failed", INVALID, raw=raw, label="special max_new_tokens given twice")
    add({**base, "tenant_id": UNKNOWN_TENANT, "prompt": "x"}, "failed", frozenset({"unknown_tenant"}))
    add({**base, "tenant_id": "a" * 64, "prompt": "x"}, "failed", frozenset({"unknown_tenant"}))
    add({**base, "prompt": "x", "adapter": "support@999999999999999999999"}, "failed", frozenset({"unknown_adapter", "invalid_job"}))
    # A whole valid job, as raw UTF-8 with a lone surrogate inside its prompt: not UTF-8, so not JSON text.
    raw = ('{"request_id": "%s", "tenant_id": "acme", "prompt": "x\ud800y", "max_new_tokens": 2}' % rid(n)).encode("utf-8", "surrogatepass")
    add(base, "one", raw=raw, label="special raw surrogate in prompt")
    return cases


def drawn_cases(start: int, n_garbage: int, n_valid: int, n_bad: int, vocab: int = DEMO_VOCAB) -> list[Case]:
    """Hypothesis' share of the batch: arbitrary JSON values and bytes, valid jobs, jobs with one bad field."""
    cases: list[Case] = []
    for value, how in draw(st.tuples(json_values, st.sampled_from(["ascii", "utf8", "utf16"])), n_garbage):
        if isinstance(value, dict):  # without an identity it cannot be answered, whatever else it holds
            value.pop("request_id", None)
            value.pop("tenant_id", None)
        cases.append(Case(Message(encode(value, how), None, f"garbage {how} {type(value).__name__}"), "dlq"))
    for raw in draw(st.binary(min_size=1, max_size=200), n_garbage // 2):
        cases.append(Case(Message(raw, None, "garbage bytes"), "dlq"))
    i = start
    for job, tenant, how in draw(st.tuples(valid_jobs(vocab), st.sampled_from(TENANTS), st.sampled_from(["ascii", "utf8"])), n_valid):
        job = {**job, "request_id": f"fz-{i}", "tenant_id": tenant}
        cases.append(Case(Message(encode(job, how), (tenant, f"fz-{i}"), f"valid {json.dumps(job)[:80]}", key=f"fz-{i}".encode()), "succeeded"))
        i += 1
    for job, (fld, value, codes) in draw(st.tuples(valid_jobs(vocab), bad_fields), n_bad):
        job = {**job, fld: value, "request_id": f"fz-{i}", "tenant_id": "acme"}
        cases.append(Case(Message(encode(job, "ascii"), ("acme", f"fz-{i}"), f"bad {fld}={json.dumps(value, allow_nan=True)[:40]}",
                                  key=f"fz-{i}".encode()), "failed", codes))
        i += 1
    return cases
