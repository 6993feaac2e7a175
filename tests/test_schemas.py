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
        (_with(prompt=None), "invalid_job", None, True, "exactly one of prompt"),
        (_with(input_ids=[1, 2]), "invalid_job", None, True, "exactly one of prompt"),
        (_with(max_new_tokens=0), "invalid_job", "max_new_tokens", True, "greater than or equal to 1"),
        (_with(temperature=-1), "invalid_job", "temperature", True, "temperature"),
        (_with(top_p=0), "invalid_job", "top_p", True, "greater than 0"),
        (_with(colour="red"), "invalid_job", "colour", True, "remove `colour`"),
        (_with(prompt=""), "invalid_job", None, True, "prompt is empty"),
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


def test_rejection_keeps_identity_for_the_result():
    r = parse_job(_with(max_new_tokens=-5, batch_id="b1"))
    assert (r.request_id, r.tenant_id, r.batch_id) == ("r1", "acme", "b1")


def test_messages_and_input_ids_jobs():
    assert isinstance(parse_job(_with(prompt=None, messages=[{"role": "user", "content": "hi"}])), Job)
    assert isinstance(parse_job(_with(prompt=None, input_ids=[1, 2, 3])), Job)
    bad_role = parse_job(_with(prompt=None, messages=[{"role": "robot", "content": "hi"}]))
    assert isinstance(bad_role, Rejection) and bad_role.error.field == "messages.0.role"
