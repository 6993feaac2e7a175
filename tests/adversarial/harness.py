"""What every adversarial scenario shares: a live worker on a fresh engine, producing with offsets, reading
the results and DLQ topics; the accounting of each message's outcomes and the ledger's conservation check at
its end are tests/adversarial/accounting.py (`close_scenario`).

The invariants (issue 15, item 8), checked the same way in every scenario:
- the worker is alive at the end (its task is not done);
- every message is answered exactly once or dead-lettered: results are counted per (tenant_id,
  request_id) against the messages sent with that identity (a duplicate *message* may get its own
  result, a single message never two), DLQ records per source (partition, offset);
- one ledger row per (tenant, request_id), with its real usage;
- GPU busy == attributed: the busy records of the run's worker sum to its usage rows' base_us + lora_us.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer, TopicPartition

from consumer.config import Settings, WorkerConfig
from consumer.kafka import make_consumer
from consumer.schemas import DlqRecord, Result
from consumer.worker import Worker
from tests.adversarial.accounting import Identity, account
from tests.service_fixtures import service_settings

log = logging.getLogger("lorabatch.adversarial")


PRODUCER_MAX_BYTES = 4 * 1_048_576


# ---------------------------------------------------------------- settings and the worker


async def adversarial_settings(broker, tmp_path, ledger_url: str, model_dir, **extra) -> Settings:
    """The service fixtures' settings with a worker id of the run's own (to find its busy records) and a
    fast GPU-time flush; a spool file in tmp_path where the worker has one."""
    run = uuid.uuid4().hex[:8]
    defaults = {
        "worker.worker_id": f"adv-{run}",
        "worker.ledger_flush_ms": 100,
        "worker.commit_interval_ms": 50,
        "kafka.partitions": 2,
    }
    if "spool_path" in WorkerConfig.model_fields:
        defaults["worker.spool_path"] = str(tmp_path / f"spool-{run}.sqlite")
    return await service_settings(broker, tmp_path, ledger_url, model_dir, **{**defaults, **extra})


@dataclass
class LiveWorker:
    worker: Worker
    task: asyncio.Task
    exit_error: BaseException | None = None

    @property
    def worker_id(self) -> str:
        return self.worker.worker_id

    def alive(self) -> bool:
        return not self.task.done()

    def death(self) -> str:
        """Why the task ended, for an assertion message."""
        if not self.task.done():
            return "alive"
        if self.task.cancelled():
            return "cancelled"
        exc = self.task.exception()
        return "returned" if exc is None else f"died: {type(exc).__name__}: {exc}"

    async def stop(self, timeout_s: float = 45.0) -> None:
        """Ask it to drain and exit; cancel it past `timeout_s`. Its own failure is kept in exit_error, not raised
        (the scenario asserted aliveness before), and a cancellation of the caller goes through."""
        if not self.task.done():
            self.worker.stop()
            done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
            if not done:
                log.error("worker %s did not stop within %ss; cancelled", self.worker_id, timeout_s)
                self.task.cancel()
                await asyncio.wait({self.task}, timeout=10)
        if self.task.done() and not self.task.cancelled():
            self.exit_error = self.task.exception()


@contextlib.asynccontextmanager
async def live_worker(settings: Settings, services):
    """A worker on an engine of its own (a fuzz input that kills one engine cannot spill into the next test)."""
    from engine.engine import Engine

    engine = await asyncio.to_thread(Engine, settings.engine)
    worker = Worker(settings, engine, services.registry, services.ledger)
    lw = LiveWorker(worker, asyncio.create_task(worker.run(), name=f"worker-{worker.worker_id}"))
    try:
        yield lw
    finally:
        await lw.stop()


def register_two_tenants(svc, demo_set) -> dict[str, str]:
    """acme and globex, each with a default adapter of its own; their refs by tenant."""
    names = sorted(demo_set["adapters"])
    refs = {}
    for tenant, adapter, path in (("acme", "support", names[0]), ("globex", "chat", names[2])):
        svc.registry.add_tenant(tenant)
        view, _ = svc.registry.add_adapter(tenant, adapter, demo_set["adapters"][path], default=True)
        refs[tenant] = view.adapter
    return refs


# ---------------------------------------------------------------- producing


@dataclass(frozen=True)
class Sent:
    """One message as produced: where it landed, and the identity it should be answered under (None: DLQ)."""

    value: bytes | None
    partition: int
    offset: int
    identity: Identity | None
    label: str = ""

    @property
    def source(self) -> tuple[int, int]:
        return self.partition, self.offset

    def describe(self) -> str:
        size = "null" if self.value is None else f"{len(self.value)}B"
        return f"{self.label or 'message'}@{self.partition}:{self.offset} ({size}, {self.identity})"


@dataclass(frozen=True)
class Message:
    value: bytes | None
    identity: Identity | None
    label: str = ""
    key: bytes | None = None
    partition: int | None = None


def job_message(job: dict, label: str = "", *, partition: int | None = None) -> Message:
    """A JSON job answerable under its (tenant_id, request_id)."""
    return Message(json.dumps(job).encode(), (job["tenant_id"], job["request_id"]), label or job["request_id"],
                   key=job["request_id"].encode(), partition=partition)


async def produce(settings: Settings, messages: list[Message]) -> list[Sent]:
    """Send every message to the jobs topic, in order; where each landed.

    A producer of the test's own, not the project's: a hostile producer does not hold to
    kafka.max_message_bytes, so this one sends up to the broker's own limit."""
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka.bootstrap_servers, client_id="adversarial", acks="all",
                                enable_idempotence=False, max_request_size=PRODUCER_MAX_BYTES, linger_ms=5)
    await producer.start()
    try:
        futures = []
        for i, m in enumerate(messages):
            key = m.key if m.key is not None else (None if m.value is not None else f"null-{i}".encode())
            futures.append(await producer.send(settings.kafka.jobs_topic, m.value, key=key, partition=m.partition))
        metadata = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return [Sent(m.value, md.partition, md.offset, m.identity, m.label) for m, md in zip(messages, metadata)]


# ---------------------------------------------------------------- reading results and DLQ records


class Collector:
    """Reads the results and DLQ topics from their beginning, incrementally, keeping each record's size."""

    def __init__(self, settings: Settings):
        self.s = settings
        self.results: list[Result] = []
        self.dlq: list[tuple[DlqRecord, int]] = []  # (record, serialized size)
        self.unreadable: list[str] = []  # records of either topic that are not valid JSON of their model
        self._consumer = None
        self._seen: set = set()

    async def __aenter__(self) -> "Collector":
        k = self.s.kafka
        self._consumer = make_consumer(k, group_id=None, client_id="adversarial-reader")
        await self._consumer.start()
        tps = [TopicPartition(t, p) for t in (k.results_topic, k.dlq_topic) for p in range(k.partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 200) -> None:
        batches = await self._consumer.getmany(timeout_ms=timeout_ms)
        for tp, records in batches.items():
            for m in records:
                if (tp, m.offset) in self._seen:  # re-read after an offset reset of this reader: counted once
                    continue
                self._seen.add((tp, m.offset))
                try:
                    if tp.topic == self.s.kafka.results_topic:
                        self.results.append(Result.model_validate_json(m.value))
                    else:
                        self.dlq.append((DlqRecord.model_validate_json(m.value), len(m.value or b"")))
                except ValueError as e:
                    self.unreadable.append(f"{tp.topic}@{tp.partition}:{m.offset}: {str(e)[:200]}")

    async def until(self, predicate, timeout_s: float) -> bool:
        """Read until `predicate(self)` holds or the time is up; whether it holds."""
        deadline = time.monotonic() + timeout_s
        while not predicate(self):
            if time.monotonic() > deadline:
                return False
            await self.poll()
        return True

    async def settle(self, quiet_s: float = 1.0) -> None:
        """Read on until nothing new has come for `quiet_s` (late duplicates show up here)."""
        seen = -1
        while seen != len(self.results) + len(self.dlq):
            seen = len(self.results) + len(self.dlq)
            deadline = time.monotonic() + quiet_s
            while time.monotonic() < deadline:
                await self.poll(100)

    def results_of(self, identity: Identity) -> list[Result]:
        return [r for r in self.results if (r.tenant_id, r.request_id) == identity]

    def answered(self, sent: list[Sent]) -> bool:
        """Every message has at least one outcome."""
        return not account(sent, self).lost
