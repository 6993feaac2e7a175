"""`lorabatch results` against topics that other programs also write: what it reads there that is not a lorabatch
record of the batch is skipped, never shown as the batch's answer, and never ends the command."""

from __future__ import annotations

import asyncio
import json

from consumer.schemas import BatchManifest
from consumer.submit import collect_results, manifest_from_jobs
from tests.test_submit_results import _produce, _result, _settings


def _job(rid: str, tenant: str = "acme", batch: str = "b1") -> dict:
    return {"tenant_id": tenant, "batch_id": batch, "request_id": rid, "prompt": "hi"}


def test_a_batch_found_in_the_jobs_topic_has_only_the_jobs_the_workers_can_name(broker):
    """With no manifest, the batch's jobs are the jobs topic's records that the workers read as the batch's (parse_job):
    a record nested too deeply is skipped (json.loads raised RecursionError and `results` ended in a traceback), and a
    record the workers cannot read an identity from (UTF-16 JSON, a request_id given twice) is not waited for (its
    dead-letter record names no request, so `results` waited out its whole timeout for it and said no worker ran)."""
    s, _ = _settings(broker)
    values = [
        json.dumps(_job("r1")).encode(),
        b"[" * 100_000,
        json.dumps(_job("r2")).encode("utf-16"),
        b'{"tenant_id": "acme", "batch_id": "b1", "request_id": "r3", "request_id": "r4", "prompt": "hi"}',
        json.dumps(_job("r5", tenant="globex")).encode(),
        json.dumps(_job("r6", batch="b2")).encode(),
        json.dumps({**_job("r7"), "max_new_tokens": -1}).encode(),  # answered: a failed result names it
    ]
    asyncio.run(_produce(s, s.kafka.jobs_topic, values, key=b"acme"))  # one partition: read in order
    manifest = asyncio.run(manifest_from_jobs(s.kafka, "acme", "b1", timeout_s=10))
    assert manifest is not None and manifest.request_ids == ["r1", "r7"]


def test_a_request_with_a_result_and_a_dlq_record_is_answered_by_its_result_whatever_is_read_first(broker):
    """A result too large for the broker goes out as a small failed result and a DLQ record of the same request; the
    result is the answer `results` writes. What the topics held is read whole before a DLQ record alone is taken as the
    last word: collecting stopped at the DLQ record when it was read before the result (here behind 3 MB of another
    tenant's results), and the same batch came out as `dlq` or `failed` by which topic a fetch brought first."""
    from consumer.schemas import DlqRecord, ErrorInfo, Result
    from tests.test_submit_results import _dlq

    s, _ = _settings(broker)
    k = s.kafka
    failed = Result(request_id="r1", tenant_id="acme", batch_id="b1", status="failed",
                    error=ErrorInfo(code="result_too_large", message="over the limit"))
    asyncio.run(_produce(s, k.results_topic, [_result("globex", "r1", "x" * 300_000)] * 60 + [failed.model_dump_json().encode()],
                         key=b"r1"))
    asyncio.run(_produce(s, k.dlq_topic, [_dlq("acme", "r1")]))
    manifest = BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1"])
    got, dlq = asyncio.run(collect_results(k, manifest, 20))
    assert got["r1"].error.code == "result_too_large" and got["r1"].tenant_id == "acme"
    assert isinstance(dlq.get("r1"), DlqRecord)


def test_tombstones_headers_and_broken_bytes_on_the_results_topics_are_skipped(broker):
    """A tombstone (no value), a record with headers (a forged marker header among them), bytes that are not UTF-8 and a
    JSON string with a lone surrogate, on the results and DLQ topics, are skipped; the batch's own result is found."""
    from consumer.kafka import make_producer
    from consumer.undecodable import HEADER

    s, _ = _settings(broker)
    k = s.kafka
    ours = _result("acme", "r1", "ours")

    async def write() -> None:
        producer = make_producer(k)
        await producer.start()
        try:
            for topic in (k.results_topic, k.dlq_topic):
                await producer.send_and_wait(topic, None, key=b"r1")
                await producer.send_and_wait(topic, b'{"request_id": "r1", "tenant_id": "acme", "status": "succeeded", '
                                                    b'"text": "\xff\xfe"}', key=b"r1")
                await producer.send_and_wait(topic, b'{"request_id": "r1", "tenant_id": "acme", "status": "succeeded", '
                                                    b'"text": "\\ud800"}', key=b"r1")
            await producer.send_and_wait(k.results_topic, ours, key=b"r1", headers=[(HEADER, b"forged"), ("trace", b"\x00")])
        finally:
            await producer.stop()

    asyncio.run(write())
    manifest = BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1"])
    got, dlq = asyncio.run(collect_results(k, manifest, 20))
    assert {rid: r.text for rid, r in got.items()} == {"r1": "ours"} and dlq == {}
