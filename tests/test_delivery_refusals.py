"""Delivery against a broker that refuses writes to the results or DLQ topic for the worker as a whole (an ACL that
lacks WRITE): a condition of the cluster, not of one message, so the outcomes wait for it to be fixed; they are not
replaced, dropped, billed as failures and committed past.

The refusal is made by the counting producer of tests/test_delivery.py (the embedded broker has no ACLs)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import ClusterAuthorizationFailedError, TopicAuthorizationFailedError

from consumer.delivery import Outcome
from consumer.schemas import DlqRecord, ErrorInfo, dlq_record
from tests.test_delivery import _outcome, _results, rig  # noqa: F401 - the rig fixture


@pytest.mark.parametrize("error", [TopicAuthorizationFailedError, ClusterAuthorizationFailedError])
async def test_a_results_topic_that_refuses_the_worker_is_waited_for(rig, caplog, error):
    """Results refused for want of a grant are sent as they are once the grant comes, and billed as succeeded: each
    was replaced by a `result_undeliverable` failure, that too refused and dropped, its row billed `failed` and its
    offset committed, so a missing ACL consumed every job of the topic for nothing."""
    s, svc, d, counting, ledger, offsets, spool = rig
    counting.fail = [error(s.kafka.results_topic) for _ in range(4)]
    with caplog.at_level("WARNING", logger="lorabatch.worker"):
        await asyncio.wait_for(d.deliver([_outcome(0), _outcome(1)]), 30)
    sent = _results(counting)
    assert len(sent) == 2 and all('"succeeded"' in r for r in sent), sent
    assert d.metrics.undeliverable._value.get() == 0
    assert svc.ledger.usage_for("acme", "r0").status == "succeeded"
    assert not [t for t, _ in counting.sent if t.endswith(".dlq")]
    waits = [r.getMessage() for r in caplog.records if "waiting for the broker to publish" in r.getMessage()]
    assert waits and s.kafka.results_topic in waits[0] and "WRITE" in waits[0], waits
    # A cluster-level refusal is a grant on the cluster (IDEMPOTENT_WRITE), not only one on the topic.
    assert ("IDEMPOTENT_WRITE on the cluster" in waits[0]) == (error is ClusterAuthorizationFailedError), waits


async def test_a_dlq_topic_that_refuses_the_worker_is_waited_for(rig):
    """A DLQ record refused for want of a grant is sent once the grant comes: it was dropped, and the bad message's
    offset committed past with no record of it anywhere."""
    s, svc, d, counting, ledger, offsets, spool = rig
    record = dlq_record(b"not json", ErrorInfo(code="malformed_json", message="x"), topic="jobs", partition=0, offset=0,
                        timestamp_ms=None, worker_id="w1", max_bytes=s.kafka.max_message_bytes)
    counting.fail = [TopicAuthorizationFailedError(s.kafka.dlq_topic) for _ in range(3)]
    await asyncio.wait_for(d.deliver([Outcome(TopicPartition("jobs", 0), 0, dlq=record, epoch=1)]), 30)
    assert [t for t, _ in counting.sent if t.endswith(".dlq")] == [s.kafka.dlq_topic]
    assert d.metrics.undeliverable._value.get() == 0
    assert isinstance(DlqRecord.model_validate_json(counting.sent[0][1]), DlqRecord)


async def test_a_result_the_broker_refuses_is_billed_with_the_body_that_went_out(rig):
    """A result the broker refuses outright at publish (MessageSizeTooLarge from a broker whose limit is below
    kafka.max_message_bytes) goes out as a small failed result; the ledger row kept the refused body, status
    `succeeded` inside a `failed` row: a resend replayed a result nobody was sent, and `lorabatch results`, which
    writes the ledger's copy where two runs disagree, would have written it."""
    from aiokafka.errors import MessageSizeTooLargeError

    s, svc, d, counting, ledger, offsets, spool = rig
    counting.fail = [MessageSizeTooLargeError("over the broker's limit")]
    await asyncio.wait_for(d.deliver([_outcome(0, text="long answer")]), 30)
    [sent] = _results(counting)
    row = svc.ledger.usage_for("acme", "r0")
    assert row.status == "failed" and row.error_code == "result_undeliverable"
    assert row.result_json == sent and '"long answer"' not in row.result_json
