"""Delivery: publish results and DLQ records, write ledger rows, and only then mark offsets done.

Outcomes queue in an outbox that a single task flushes in batches (one produce round and one ledger
statement per flush). A broker or database hiccup is retried with backoff and the outcomes stay in the
outbox meanwhile, so a drain waits for them and nothing is committed before it is saved. A record the
ledger refuses outright (not retriable) goes to the DLQ with the reason instead of blocking its
partition forever.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from billing.errors import LedgerError
from billing.records import UsageRecord
from consumer.config import KafkaConfig
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import DlqRecord, ErrorInfo, Result

log = logging.getLogger("lorabatch.worker")


@dataclass
class Outcome:
    """What one message produced; delivered before its offset counts as done."""

    tp: TopicPartition
    offset: int
    result: Result | None = None
    usage: UsageRecord | None = None
    dlq: DlqRecord | None = None


class Deliverer:
    def __init__(self, kafka: KafkaConfig, producer: AIOKafkaProducer, ledger, offsets: OffsetTracker,
                 metrics: WorkerMetrics, worker_id: str, known_tenant: Callable[[str], bool]):
        self.k = kafka
        self.producer = producer
        self.ledger = ledger
        self.offsets = offsets
        self.metrics = metrics
        self.worker_id = worker_id
        self.known_tenant = known_tenant
        self.outbox: list[Outcome] = []
        self._event = asyncio.Event()

    def emit(self, outcome: Outcome) -> None:
        self.outbox.append(outcome)
        self._event.set()

    async def run(self) -> None:
        while True:
            await self._event.wait()
            self._event.clear()
            if not self.outbox:
                continue
            batch = self.outbox[:]  # stays in the outbox until delivered, so a drain waits for it
            delay = 0.1
            while True:
                try:
                    await self.deliver(batch)
                    del self.outbox[: len(batch)]
                    break
                except (KafkaError, OSError) as e:
                    log.warning("publishing %d outcomes failed (%s); retrying in %.1fs", len(batch), e, delay)
                except LedgerError as e:
                    log.warning("ledger write of %d outcomes failed (%s); retrying in %.1fs", len(batch), e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def drain(self) -> None:
        """Wait until everything emitted so far is delivered."""
        self._event.set()
        while self.outbox:
            await asyncio.sleep(0.01)

    async def deliver(self, batch: list[Outcome]) -> None:
        sends = []
        for o in batch:
            if o.result is not None:
                sends.append(await self.producer.send(
                    self.k.results_topic, o.result.model_dump_json().encode(), key=o.result.request_id.encode()))
            if o.dlq is not None:
                sends.append(await self.producer.send(self.k.dlq_topic, o.dlq.model_dump_json().encode()))
        await asyncio.gather(*sends)
        billed = [o for o in batch if o.usage is not None]
        if billed:
            try:
                await asyncio.to_thread(self.ledger.record_usage, [o.usage for o in billed])
            except LedgerError as e:
                if e.retriable:
                    raise
                await self._record_one_by_one(billed)
        for o in batch:
            self.offsets.finished(o.tp, o.offset)
            if o.result is not None:
                self._count(o.result)

    def _count(self, r: Result) -> None:
        tenant = r.tenant_id if self.known_tenant(r.tenant_id) else "unknown"
        adapter = r.adapter or ("base" if r.route.startswith("base_fallback") else "none")
        self.metrics.requests.labels(tenant, adapter, r.status).inc()
        if r.status == "succeeded":
            self.metrics.duration.labels(tenant).observe(r.timings.total_ms / 1000)
            self.metrics.routing_cost.labels(tenant).inc(r.cost.routing_ms)

    async def _record_one_by_one(self, batch: list[Outcome]) -> None:
        """The ledger refused a batch for a bad record: write the others, send the refused ones to the DLQ."""
        for o in batch:
            try:
                await asyncio.to_thread(self.ledger.record_usage, [o.usage])
            except LedgerError as e:
                if e.retriable:
                    raise
                raw = (o.result.model_dump_json() if o.result else "").encode()
                record = DlqRecord(
                    error=ErrorInfo(code="ledger_rejected", message=str(e)), source_topic=o.tp.topic,
                    source_partition=o.tp.partition, source_offset=o.offset, raw=raw.decode(),
                    raw_b64=base64.b64encode(raw).decode(), request_id=o.usage.request_id,
                    tenant_id=o.usage.tenant_id, batch_id=o.usage.batch_id, worker_id=self.worker_id)
                log.error("ledger refused %s/%s: %s; sent to the DLQ", o.usage.tenant_id, o.usage.request_id, e)
                self.metrics.dlq.labels("ledger_rejected").inc()
                await self.producer.send_and_wait(self.k.dlq_topic, record.model_dump_json().encode())
