"""What every adversarial scenario shares: a live worker on a fresh engine, producing with offsets, reading
the results and DLQ topics, accounting each message's outcomes, and the ledger's conservation check.

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
import base64
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aiokafka import AIOKafkaProducer, TopicPartition
from sqlalchemy import Engine as SqlEngine
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from billing.models import Busy, Usage
from consumer.config import Settings, WorkerConfig
from consumer.kafka import make_consumer
from consumer.schemas import DlqRecord, Result
from consumer.worker import Worker
from tests.service_fixtures import service_settings

log = logging.getLogger("lorabatch.adversarial")

Identity = tuple[str, str]  # (tenant_id, request_id)
PRODUCER_MAX_BYTES = 4 * 1_048_576


# ---------------------------------------------------------------- the closing note's table


@dataclass
class Tally:
    """One scenario's row of the closing note: what it threw at the worker and what went wrong."""

    scenario: str
    cases: int = 0  # messages sent
    lost: int = 0  # messages without any result or DLQ record
    double_billed: int = 0  # identities with more than one ledger row, or billed again on redelivery
    published_twice: int = 0  # messages answered more than once (results beyond their messages, DLQ copies)
    dead_workers: int = 0  # workers whose task had ended by the end of the scenario
    unbilled: int = 0  # identities of registered tenants without their ledger row (or with a wrong one)
    busy_gap_us: int = 0  # busy - attributed for the run's worker
    dlq: int = 0  # DLQ records read
    outcome: str = "unknown"
    failure: str = ""
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text[:500])


def append_report(path: str, tally: Tally) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(asdict(tally), sort_keys=True) + "\n")


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
        refs[tenant] = view.ref
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


@dataclass
class Accounting:
    lost: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # answered more often than sent
    stray: list[str] = field(default_factory=list)  # results for an identity nobody sent
    results: dict[Identity, list[Result]] = field(default_factory=dict)
    dlq: dict[tuple[int, int], list[DlqRecord]] = field(default_factory=dict)


def account(sent: list[Sent], col: Collector) -> Accounting:
    """Each message's outcomes: results by identity (shared among duplicate messages), DLQ records by source."""
    out = Accounting()
    jobs_topic = col.s.kafka.jobs_topic
    for record, _ in col.dlq:
        if record.source_topic == jobs_topic:
            out.dlq.setdefault((record.source_partition, record.source_offset), []).append(record)
    by_identity: dict[Identity, list[Result]] = defaultdict(list)
    for r in col.results:
        by_identity[(r.tenant_id, r.request_id)].append(r)
    groups: dict[object, list[Sent]] = defaultdict(list)
    for m in sent:
        groups[m.identity if m.identity is not None else ("offset", m.source)].append(m)
    for key, members in groups.items():
        results = by_identity.get(key, []) if members[0].identity is not None else []
        dlq = [d for m in members for d in out.dlq.get(m.source, [])]
        got, want = len(results) + len(dlq), len(members)
        if got < want:
            out.lost.extend(m.describe() for m in members[: want - got])
        if got > want:
            out.extra.append(f"{members[0].describe()}: {len(results)} results + {len(dlq)} DLQ records for {want} message(s)")
        for m in members:
            if len(out.dlq.get(m.source, [])) > 1:
                out.extra.append(f"{m.describe()}: {len(out.dlq[m.source])} DLQ records")
        if members[0].identity is not None:
            out.results[members[0].identity] = results
    sent_ids = {m.identity for m in sent if m.identity is not None}
    for identity, results in by_identity.items():
        if identity not in sent_ids:
            out.stray.append(f"{identity}: {len(results)} result(s), e.g. {results[0].error}")
    return out


def dlq_problems(record: DlqRecord, size: int, original: bytes | None, max_bytes: int) -> list[str]:
    """What is wrong with one DLQ record of `original`: its size, its fingerprint of the whole value, its excerpt."""
    raw = original or b""
    problems = []
    where = f"DLQ record of {record.source_partition}:{record.source_offset} ({len(raw)}B, {record.error.code})"
    if size >= max_bytes:
        problems.append(f"{where} is {size}B, not under kafka.max_message_bytes={max_bytes}")
    if getattr(record, "raw_bytes", None) != len(raw):
        problems.append(f"{where}: raw_bytes={getattr(record, 'raw_bytes', None)!r}, want {len(raw)}")
    if getattr(record, "raw_sha256", None) != hashlib.sha256(raw).hexdigest():
        problems.append(f"{where}: raw_sha256={getattr(record, 'raw_sha256', None)!r}, want the sha256 of the whole value")
    try:
        head = base64.b64decode(record.raw_b64, validate=True)
    except ValueError:
        problems.append(f"{where}: raw_b64 is not base64")
    else:
        if not raw.startswith(head):
            problems.append(f"{where}: raw_b64 holds {len(head)}B that are not a prefix of the message")
        if len(raw) > 0 and not head:
            problems.append(f"{where}: raw_b64 keeps nothing of the message")
    if not isinstance(record.raw, str):
        problems.append(f"{where}: raw is not text")
    return problems


# ---------------------------------------------------------------- the ledger


def usage_rows(db: SqlEngine, identities) -> dict[Identity, list[Usage]]:
    wanted = set(identities)
    tenants = {t for t, _ in wanted}
    with Session(db) as session:
        rows = session.scalars(select(Usage).where(Usage.tenant_id.in_(tenants))).all()
        session.expunge_all()
    out: dict[Identity, list[Usage]] = {i: [] for i in wanted}
    for row in rows:
        if (row.tenant_id, row.request_id) in wanted:
            out[(row.tenant_id, row.request_id)].append(row)
    return out


def row_dict(row: Usage) -> dict:
    return {c.key: getattr(row, c.key) for c in Usage.__table__.columns}


def busy_and_attributed(db: SqlEngine, worker_id: str) -> tuple[int, int]:
    with Session(db) as session:
        busy = session.scalar(select(func.sum(Busy.busy_us)).where(Busy.worker_id == worker_id))
        attributed = session.scalar(select(func.sum(Usage.base_us + Usage.lora_us)).where(Usage.worker_id == worker_id))
    return int(busy or 0), int(attributed or 0)


async def wait_conserved(db: SqlEngine, worker_id: str, timeout_s: float = 15.0) -> tuple[int, int]:
    """(busy, attributed) of the worker once they agree, or as they stand when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            busy, attributed = await asyncio.to_thread(busy_and_attributed, db, worker_id)
        except (SQLAlchemyError, OSError) as e:  # the database may still be coming back
            log.info("conservation query failed (%s); retrying", e)
            busy, attributed = -1, 0
        if busy == attributed and busy >= 0 or time.monotonic() > deadline:
            return busy, attributed
        await asyncio.sleep(0.2)


async def wait_rows(db: SqlEngine, identities, timeout_s: float) -> dict[Identity, list[Usage]]:
    """The identities' ledger rows once each has one, or as they stand when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = await asyncio.to_thread(usage_rows, db, identities)
        except (SQLAlchemyError, OSError) as e:  # the database may still be coming back
            log.info("ledger query failed (%s); retrying", e)
            rows = None
        if rows is not None and all(rows.values()) or time.monotonic() > deadline:
            return rows or {i: [] for i in identities}
        await asyncio.sleep(0.3)


def ledger_problems(rows: dict[Identity, list[Usage]], expect: dict[Identity, str], results: dict[Identity, list[Result]]) -> tuple[list[str], list[str]]:
    """(unbilled, double billed): each identity of `expect` ("succeeded", "failed", "none" or "result" -- the
    status its result got) against its ledger rows."""
    unbilled, double = [], []
    for identity, want in expect.items():
        got = rows.get(identity, [])
        if want == "result":
            published = results.get(identity, [])
            want = published[0].status if published else "none"
        if want == "none":
            if got:
                double.append(f"{identity}: {len(got)} ledger row(s), want none")
            continue
        if len(got) > 1:
            double.append(f"{identity}: {len(got)} ledger rows")
        if not got:
            unbilled.append(f"{identity}: no ledger row, want one {want}")
            continue
        row = got[0]
        if row.status != want:
            unbilled.append(f"{identity}: ledger row {row.status} ({row.error_code}), want {want}")
        elif want == "succeeded" and not (row.output_tokens > 0 and row.base_us > 0):
            unbilled.append(f"{identity}: succeeded row without its usage (output_tokens={row.output_tokens}, base_us={row.base_us})")
    return unbilled, double


def result_problems(results: dict[Identity, list[Result]], expect: dict[Identity, tuple[str, frozenset | None]]) -> list[str]:
    """Each identity's results against (status wanted or "result" for either, allowed error codes or None)."""
    problems = []
    for identity, (want, codes) in expect.items():
        for r in results.get(identity, []):
            if want in ("succeeded", "failed") and r.status != want:
                problems.append(f"{identity}: {r.status} ({r.error}), want {want}")
                continue
            if r.status == "failed":
                code = r.error.code if r.error else None
                if code == "engine_error":
                    problems.append(f"{identity}: engine_error (a bug on the worker's side): {r.error.message}")
                elif codes is not None and code not in codes:
                    problems.append(f"{identity}: failed with {code}, want one of {sorted(codes)}: {r.error.message if r.error else ''}")
            if r.status == "succeeded" and not (r.usage.output_tokens > 0 and r.cost.base_ms > 0):
                problems.append(f"{identity}: succeeded without usage: {r.usage}, {r.cost}")
    return problems


def fill_tally(t: Tally, sent: list[Sent], acct: Accounting, col: Collector, workers: list[LiveWorker],
               unbilled: list[str] = (), double: list[str] = (), busy: tuple[int, int] | None = None) -> None:
    t.cases = len(sent)
    t.lost = len(acct.lost)
    t.published_twice = len(acct.extra) + len(acct.stray)
    t.dead_workers = sum(not w.alive() for w in workers)
    t.unbilled = len(unbilled)
    t.double_billed = len(double)
    t.dlq = len(col.dlq)
    if busy is not None:
        t.busy_gap_us = busy[0] - busy[1]
    for w in workers:
        if not w.alive():
            t.note(f"worker {w.worker_id} {w.death()}")
    for text in [*acct.lost[:3], *acct.extra[:3], *acct.stray[:3], *list(unbilled)[:3], *list(double)[:3], *col.unreadable[:3]]:
        t.note(text)


def counts(values) -> dict:
    return dict(Counter(values))
