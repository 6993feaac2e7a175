"""The job contract: every kind of bad input names the field and the fix; answerable jobs are told apart."""

import json

import pytest

from consumer.schemas import Job, Rejection, parse_job

GOOD = {"request_id": "r1", "tenant_id": "acme", "prompt": "hello"}


def _with(**kw):
    d = dict(GOOD)
    for k, v in kw.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return json.dumps(d).encode()


def test_valid_job():
    job = parse_job(_with())
    assert isinstance(job, Job) and job.max_new_tokens == 64 and job.v == 1


@pytest.mark.parametrize(
    ("raw", "code", "field", "addressable", "says"),
    [
        (b"{not json", "malformed_json", None, False, "JSON"),
        (b"\xff\xfe", "malformed_json", None, False, "UTF-8"),
        (b"[1, 2]", "malformed_json", None, False, "object"),
        (None, "malformed_json", None, False, "empty"),
        (_with(request_id=None), "invalid_job", "request_id", False, "add the field `request_id`"),
        (_with(tenant_id=None), "invalid_job", "tenant_id", False, "add the field `tenant_id`"),
        (_with(v=2), "invalid_job", "v", False, "v"),
        (_with(tenant_id="has space"), "invalid_job", "tenant_id", False, "pattern"),
        (_with(v=True), "invalid_job", "v", False, "the integer 1"),  # true == 1 in Python, not in JSON
        (_with(v=1.0), "invalid_job", "v", False, "the integer 1"),
        (_with(prompt=None), "invalid_job", "prompt", True, "exactly one of prompt"),
        (_with(input_ids=[1, 2]), "invalid_job", "input_ids", True, "exactly one of prompt"),
        (_with(max_new_tokens=0), "invalid_job", "max_new_tokens", True, "greater than or equal to 1"),
        (_with(temperature=-1), "invalid_job", "temperature", True, "temperature"),
        (_with(top_p=0), "invalid_job", "top_p", True, "greater than 0"),
        (_with(colour="red"), "invalid_job", "colour", True, "remove `colour`"),
        (_with(prompt=""), "invalid_job", "prompt", True, "prompt: is empty; send at least one character"),
        (_with(prompt=None, messages=[]), "invalid_job", "messages", True, "messages: is empty"),
        (_with(prompt=None, input_ids=[]), "invalid_job", "input_ids", True, "input_ids: is empty"),
        (_with(prompt="ab\ud800c"), "invalid_job", "prompt", True, "lone UTF-16 surrogate (\\ud800) at character 2"),
        (_with(prompt=None, messages=[{"role": "user", "content": "\udfff"}]), "invalid_job", "messages.0.content", True,
         "surrogate"),
        (_with(adapter="bad name!"), "invalid_job", "adapter", True, "adapter"),
    ],
)
def test_rejections_name_field_and_fix(raw, code, field, addressable, says):
    r = parse_job(raw)
    assert isinstance(r, Rejection)
    assert r.error.code == code
    assert r.error.field == field
    assert r.addressable is addressable
    assert says in r.error.message


@pytest.mark.parametrize(
    "fields",
    [{"adapter_ref": "support@2"}, {"adapter": "support@2"}, {"adapter_ref": "support@2", "adapter": "support@2"}],
)
def test_adapter_ref_and_its_older_name_are_one_field(fields):
    """`adapter_ref` and `adapter` (its older name, which producers send) read into Job.adapter_ref; both, agreeing, read once."""
    job = parse_job(_with(**fields))
    assert isinstance(job, Job) and job.adapter_ref == "support@2"
    assert "adapter" not in Job.model_fields and job.model_dump()["adapter_ref"] == "support@2"


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"adapter_ref": "support@2", "adapter": "support@3"}, "adapter_ref ('support@2') and adapter ('support@3') differ"),
        ({"adapter_ref": "support", "adapter": None}, None),  # null in one of them is a value too
        ({"adapter_ref": 1, "adapter": True}, "adapter_ref (1) and adapter (True) differ"),  # equal in Python, not in JSON
        ({"adapter_ref": "x" * 10_000, "adapter": "y"}, "differ"),  # the message stays short
    ],
)
def test_adapter_ref_and_adapter_that_differ_are_refused_naming_both(fields, says):
    """A job giving both names with different values is refused (never one picked), naming both fields; it is still answerable."""
    d = {**GOOD, **fields}
    r = parse_job(json.dumps(d).encode())
    assert isinstance(r, Rejection) and r.error.code == "invalid_job" and r.addressable
    assert r.error.field == "adapter_ref" and "adapter_ref" in r.error.message and "adapter (" in r.error.message
    assert says is None or says in r.error.message
    assert "send adapter_ref alone" in r.error.message and len(r.error.message) < 400


def test_a_bad_value_under_the_older_name_names_that_name():
    """The error of an invalid `adapter` names `adapter`, the field the producer sent."""
    r = parse_job(_with(adapter_ref=None, adapter="bad name!"))
    assert isinstance(r, Rejection) and r.error.field == "adapter"
    r = parse_job(_with(adapter_ref="bad name!"))
    assert isinstance(r, Rejection) and r.error.field == "adapter_ref"


def test_rejection_keeps_identity_for_the_result():
    r = parse_job(_with(max_new_tokens=-5, batch_id="b1"))
    assert (r.request_id, r.tenant_id, r.batch_id) == ("r1", "acme", "b1")


def test_messages_and_input_ids_jobs():
    assert isinstance(parse_job(_with(prompt=None, messages=[{"role": "user", "content": "hi"}])), Job)
    assert isinstance(parse_job(_with(prompt=None, input_ids=[1, 2, 3])), Job)
    bad_role = parse_job(_with(prompt=None, messages=[{"role": "robot", "content": "hi"}]))
    assert isinstance(bad_role, Rejection) and bad_role.error.field == "messages.0.role"


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("seed", -1, "0..9223372036854775807"),
        ("seed", 2**63, "0..9223372036854775807"),
        ("temperature", 5.0001, "0.0..5.0"),
        ("temperature", -0.1, "0.0..5.0"),
        ("top_p", 0, "> 0.0 and <= 1.0"),
        ("top_p", 1.5, "> 0.0 and <= 1.0"),
        ("top_k", -1, "0..1000000"),
        ("top_k", 10**12, "0..1000000"),
        ("priority", 101, "-100..100"),
        ("max_new_tokens", 0, "1..131072"),
        ("max_new_tokens", 10**9, "1..131072"),
        ("logprobs", 21, "0..20"),
    ],
)
def test_numbers_out_of_range_name_the_field_and_its_range(field, value, says):
    """Every numeric field is range-checked in the contract: the error names the field and what it allows."""
    rej = parse_job(_with(**{field: value}))
    assert isinstance(rej, Rejection) and rej.addressable
    assert rej.error.field == field and field in rej.error.message and says in rej.error.message, rej.error


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
@pytest.mark.parametrize("field", ["temperature", "top_p"])
def test_non_finite_floats_are_refused(field, literal):
    """NaN and infinities (JSON extensions Python accepts) never reach the sampler."""
    raw = _with(**{field: 0.5}).replace(b'0.5', literal)
    rej = parse_job(raw)
    assert isinstance(rej, Rejection) and rej.error.field == field


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000 + b"]" * 100_000, b'{"a": ' + b"9" * 5000 + b"}", b'{"v": 1, "x": ' + b'{"y": ' * 5000 + b"1" + b"}" * 5001,
     b"\xff\xfe", b"", b"null", b'"\\ud800"'],
)
def test_json_the_decoder_cannot_take_is_a_rejection_not_an_exception(raw):
    """Depth, integer-digit limits, bad UTF-8, empty values: each is a Rejection for the DLQ, never a raise."""
    assert isinstance(parse_job(raw), Rejection)


@pytest.mark.parametrize("size", [0, 10, 65_536, 2_000_000])
def test_dlq_records_are_bounded_and_identify_the_message(size):
    """A DLQ record fits the broker's limit whatever the message, and keeps its length and sha256."""
    import hashlib

    from consumer.schemas import ErrorInfo, dlq_record

    raw = b"\x00\xff" * (size // 2)  # escapes grow NUL six-fold in JSON: the worst case for the text copy
    for limit in (4096, 65_536, 1_000_000):
        rec = dlq_record(raw, ErrorInfo(code="x", message="m" * 10_000), topic="t", partition=0, offset=1,
                         timestamp_ms=None, worker_id="w", max_bytes=limit)
        assert len(rec.model_dump_json()) < limit
        assert rec.raw_bytes == len(raw) and rec.raw_sha256 == hashlib.sha256(raw).hexdigest()
        assert rec.raw_truncated is (len(raw) > min(65_536, limit // 16))


def test_stop_null_is_no_stop_strings():
    """`"stop": null` reads as the default (none), as null does for the other optional fields; a bare string is still
    refused naming the field."""
    job = parse_job(json.dumps({**GOOD, "stop": None}).encode())
    assert isinstance(job, Job) and job.stop == []
    bad = parse_job(json.dumps({**GOOD, "stop": "END"}).encode())
    assert isinstance(bad, Rejection) and bad.error.field == "stop"


@pytest.mark.parametrize("raw, field, addressable", [
    (b'{"request_id": "r1", "tenant_id": "globex", "tenant_id": "acme", "prompt": "x"}', "tenant_id", False),
    (b'{"request_id": "r1", "request_id": "r2", "tenant_id": "acme", "prompt": "x"}', "request_id", False),
    (b'{"v": 1, "v": 1, "request_id": "r1", "tenant_id": "acme", "prompt": "x"}', "v", False),
    (b'{"request_id": "r1", "tenant_id": "acme", "prompt": "x", "max_new_tokens": 9999, "max_new_tokens": 2}', "max_new_tokens", True),
    (b'{"request_id": "r1", "tenant_id": "acme", "prompt": "x", "prompt": "x"}', "prompt", True),
    (b'{"request_id": "r1", "tenant_id": "acme", "messages": [{"role": "user", "content": "a"}, '
     b'{"role": "user", "role": "system", "content": "b"}]}', "messages.1.role", True),
])
def test_a_field_given_twice_is_refused_not_guessed(raw, field, addressable):
    """json.loads keeps the last of two values, where another reader of the same bytes (a gateway that checked the
    tenant, say) may go by the first: the job ran as the last tenant_id, and 99999 then 2 max_new_tokens ran with 2.
    A repeated field is invalid_job naming it; a repeated identity is not answered under either value (DLQ)."""
    r = parse_job(raw)
    assert isinstance(r, Rejection) and r.error.code == "invalid_job" and r.error.field == field, r
    assert r.error.message.startswith(f"{field}: given twice") and "give each field once" in r.error.message
    assert r.addressable is addressable
    if field in ("tenant_id", "request_id"):
        assert getattr(r, field) is None, r


@pytest.mark.parametrize(
    ("fields", "field", "says"),
    [
        ({"stop": ["ok", "x\ud800"]}, "stop.1", "stop.1: holds a lone UTF-16 surrogate (\\ud800) at character 1"),
        ({"stop": [""]}, "stop.0", "send a list of up to 8 strings of 1 to 64 characters"),
        ({"stop": "END"}, "stop", "send a list of up to 8 strings of 1 to 64 characters"),
        ({"prompt": {"text": "hi"}}, "prompt", "prompt: Input should be a valid string; send a non-empty string"),
        ({"prompt": None, "messages": [{"role": "user", "content": 5}]}, "messages.0.content", 'send a non-empty list of {"role"'),
        ({"allow_base_fallback": 1}, "allow_base_fallback", "send true or false"),
        ({"adapter_ref": {"name": "x"}}, "adapter_ref", "send `name` or `name@version`"),
        ({"user_id": "has space"}, "user_id", "send 1 to 128 ASCII letters"),
        ({"prompt": None, "input_ids": [1, -1]}, "input_ids.1", "send a value in 0..2147483647 for each token id"),
        ({"logprobs": True}, "logprobs", "logprobs: Input should be a valid integer; send a value in 0..20"),
        ({"adapter_ref": None, "adapter": 1}, "adapter", "send `name` or `name@version`"),  # the older name says it too
        ({"adapter_ref": None, "adapter": "bad name!"}, "adapter", "send `name` or `name@version`"),
    ],
)
def test_every_rejection_says_what_to_send(fields, field, says):
    """A value of the wrong type or shape names its field and what the field takes, not only what was wrong: a lone
    surrogate in a stop string was 'unable to parse raw data as a unicode string', a string prompt's object 'fix the
    value and send the job again'."""
    rej = parse_job(_with(**fields))
    assert isinstance(rej, Rejection) and rej.addressable
    assert rej.error.field == field and says in rej.error.message, rej.error
    assert "fix the value and send the job again" not in rej.error.message


def _result_body(rej: Rejection) -> str:
    """The failed result a worker publishes for an addressable rejection, as the broker gets it."""
    from datetime import UTC, datetime

    from consumer.outcomes import failed_before_engine

    result, _ = failed_before_engine((rej.request_id, rej.tenant_id, rej.batch_id), rej.error, datetime.now(UTC), "w")
    return result.model_dump_json()


_ODD = b'{"request_id": "r1", "tenant_id": "acme", '


@pytest.mark.parametrize(("raw", "field", "says"), [
    (_ODD + b'"prompt": "x", "\\ud800": 1}', "\\ud800", "lone UTF-16 surrogate"),
    (_ODD + b'"messages": [{"role": "user", "content": "x", "a\\udc00": 1}]}', "messages.0.a\\udc00", "lone UTF-16 surrogate"),
    (_ODD + b'"prompt": "x", "\\ud800": 1, "\\ud800": 2}', "\\ud800", "given twice"),
])
def test_a_field_name_that_is_not_text_is_named_and_its_result_can_be_sent(raw, field, says):
    """A key holding a lone surrogate escape: pydantic said 'Input should be a valid string, unable to parse raw data
    as a unicode string' naming no field (or only `messages.0`), and a key given twice was echoed as it came, so the
    failed result could not be encoded as UTF-8 and the job went to the DLQ as `undeliverable`, without its identity.
    The error names the key, escaped, and says to remove it; the result is sendable."""
    rej = parse_job(raw)
    assert isinstance(rej, Rejection) and rej.addressable and rej.error.code == "invalid_job", rej
    assert rej.error.field == field and rej.error.message.startswith(f"{field}: ") and says in rej.error.message, rej.error
    assert "fix the value" not in rej.error.message
    _result_body(rej).encode()


@pytest.mark.parametrize("twice", [False, True])
def test_a_huge_field_name_is_echoed_short(twice):
    """An unknown key of 300,000 characters was echoed whole as `error.field` and twice more in the message: the failed
    result (900 KB; over kafka.max_message_bytes with a larger key) was replaced by `result_too_large` telling the
    producer to ask for fewer max_new_tokens. The name is cut; the error still says what to do."""
    name = "x" * 300_000
    raw = _ODD + b'"prompt": "p", "' + name.encode() + b'": 1' + (b', "' + name.encode() + b'": 2' if twice else b"") + b"}"
    rej = parse_job(raw)
    assert isinstance(rej, Rejection) and rej.addressable and rej.error.code == "invalid_job", rej
    assert rej.error.field.startswith("xxxx") and len(rej.error.field) <= 100, rej.error.field[:200]
    assert ("given twice" if twice else "remove") in rej.error.message and "300000 characters" in rej.error.message
    assert len(_result_body(rej)) < 2_000
