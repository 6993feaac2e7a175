"""A record the ledger refuses (LedgerRecordError: a CHECK an operator added, a value its column cannot hold) goes to the
DLQ as `ledger_rejected` with the whole record in its body, so finance can bill it again exactly once it is fixed: the
body held only the record's `result_json` (the answer), none of created_at, gpu_kind, tier, worker_id or the costs."""

from __future__ import annotations

import base64
import dataclasses
import json
from datetime import UTC, datetime

from aiokafka import TopicPartition

from billing.errors import LedgerRecordError
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from consumer.config import KafkaConfig
from consumer.delivery import Deliverer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import DlqRecord
from consumer.spool import Spool
from tests.test_ledger_refusals import Producer

T0 = datetime(2026, 1, 31, 23, 59, 59, 123456, tzinfo=UTC)


class _Refusing:
    """A ledger that refuses every record, as the database refuses a value its column cannot hold."""

    def record_usage(self, records):
        raise LedgerRecordError("the ledger refused the record (test): fix the record")

    record_busy = record_adapter_loads = record_usage


def _usage(result_json: str | None = '{"request_id": "r1"}', **kw) -> UsageRecord:
    return UsageRecord(tenant_id="acme", request_id="r1", status="succeeded", created_at=T0, adapter="a@1",
                       adapter_sha256="f" * 64, batch_id="b7", route_reason="l3_rule", input_tokens=11, output_tokens=7,
                       cached_tokens=3, base_us=1001, lora_us=202, routing_us=33, kv_saved_us=44, queue_us=5, ttft_us=6,
                       total_us=7, worker_id="w-9", result_json=result_json, gpu_kind="h200", tier="gold", **kw)


async def _dead(tmp_path, record, max_bytes: int = 1_000_000) -> DlqRecord:
    spool = Spool(tmp_path / "spool.sqlite", max_records=10)
    producer = Producer()
    d = Deliverer(KafkaConfig(max_message_bytes=max_bytes), producer, _Refusing(), OffsetTracker(), WorkerMetrics(),  # type: ignore[arg-type]
                  "w1", lambda t: True, spool)
    try:
        await d.write([record])
    finally:
        spool.close()
    [sent] = producer.sent[KafkaConfig().dlq_topic]
    assert len(sent) <= max_bytes
    dead = DlqRecord.model_validate_json(sent)
    assert dead.error.code == "ledger_rejected" and (dead.source_topic, dead.source_partition) == ("ledger", -1)
    assert base64.b64decode(dead.raw_b64) == dead.raw.encode()
    return dead


def _fields(record) -> dict:
    return {k: v.isoformat() if isinstance(v, datetime) else v for k, v in dataclasses.asdict(record).items()}


async def test_a_refused_usage_record_is_dead_lettered_whole(tmp_path) -> None:
    r = _usage()
    dead = await _dead(tmp_path, r)
    assert not dead.raw_truncated and json.loads(dead.raw) == {"kind": "usage", "record": _fields(r)}
    assert (dead.request_id, dead.tenant_id, dead.batch_id) == ("r1", "acme", "b7")


async def test_busy_and_load_records_refused_are_dead_lettered_whole(tmp_path) -> None:
    """A GPU-busy or adapter-load record has no result_json: its body was the record's repr (not JSON)."""
    busy = BusyRecord(worker_id="w", gpu_kind="cpu", started_at=T0, ended_at=T0, busy_us=10, steps=1)
    load = AdapterLoadRecord(adapter="a@1", adapter_sha256="0" * 64, tenant_id="acme", tier="disk", nbytes=5, load_us=7,
                             worker_id="w", created_at=T0)
    assert json.loads((await _dead(tmp_path / "b", busy)).raw) == {"kind": "busy", "record": _fields(busy)}
    assert json.loads((await _dead(tmp_path / "l", load)).raw) == {"kind": "load", "record": _fields(load)}


async def test_an_answer_too_big_for_the_dlq_leaves_the_bill_whole(tmp_path) -> None:
    """A usage record whose answer is over what a DLQ record keeps (a 16th of kafka.max_message_bytes): the answer is
    left out (it was published in the results topic), named by size and sha256; every billing field is kept whole, where
    cutting the body's tail made it JSON no one could read."""
    answer = json.dumps({"text": "\u00e9\x00" * 40_000})
    r = _usage(answer)
    dead = await _dead(tmp_path, r, max_bytes=65_536)
    body = json.loads(dead.raw)
    assert not dead.raw_truncated
    assert body["record"] == {**_fields(r), "result_json": None}
    assert body["result_json_left_out"]["bytes"] == len(answer.encode())
