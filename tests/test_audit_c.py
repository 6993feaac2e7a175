"""An outside audit's scenarios (a hostile producer, an operator on a bad day) that found something still broken."""

from __future__ import annotations

import json

import pytest

from consumer.schemas import parse_job


def _raw(request_id: str, tenant_id: str, tail: str) -> bytes:
    return ('{"request_id": %s, "tenant_id": %s, %s}' % (json.dumps(request_id), json.dumps(tenant_id), tail)).encode()


@pytest.mark.parametrize("request_id, tenant_id", [
    ("r" * 129, "acme"),  # past the 128 characters of a request id
    ("r" * 256, "acme"),
    ("ok", "-acme"),  # a tenant id starts with a letter or digit
    ("ok", "ac:me"),  # ':' is a request id's character, not a tenant id's
    ("ok", "t" * 65),
])
@pytest.mark.parametrize("tail", [
    '"prompt": "a", "prompt": "b"',  # a field given twice
    '"messages": [{"role": "user", "content": "a", "content": "b"}]',  # inside a chat message
])
def test_a_job_with_an_unusable_identity_is_dead_lettered_whatever_else_is_wrong(request_id, tenant_id, tail):
    """A request id or tenant id outside its contract is no usable identity: the message goes to the DLQ. Only the
    validation error's path checked that; a job that also gave a field twice was answered (and billed a row) under a
    200-character request id, or under a tenant id no tenant can have."""
    rej = parse_job(_raw(request_id, tenant_id, tail))
    assert not rej.addressable, rej


def test_a_job_with_a_usable_identity_and_a_field_given_twice_is_answered():
    rej = parse_job(_raw("r" * 128, "acme", '"prompt": "a", "prompt": "b"'))
    assert rej.addressable and rej.error.field == "prompt", rej
    assert (rej.request_id, rej.tenant_id) == ("r" * 128, "acme")
