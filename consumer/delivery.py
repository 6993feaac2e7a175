"""Delivery: publish results and DLQ records once, bill them (ledger or spool), and only then mark offsets done.

Outcomes queue in an outbox that one task flushes in batches, in two stages:

1. Publish. Each outcome's result and DLQ record is sent once; an outcome that is published is never
   sent again, whatever fails later. A broker that does not answer is waited for (a log line and the
   `lorabatch_waiting` gauge say so); a message the broker can never take (larger than
   `kafka.max_message_bytes`, or refused outright) is replaced by a small failed result naming why,
   and its body goes to the DLQ, cut to size with its length and sha256, so nothing retries forever.
2. Bill. Usage rows go to the ledger in one statement. A record the ledger refuses (it is malformed)
   goes to the DLQ with the reason; when the ledger is down or behind its schema, the records go to the
   durable local spool (consumer/spool.py) and a flusher writes them when it is back. Either way the
   outcomes are then done and their offsets may commit. The spool's flusher is consumer.spool_flush.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import ClusterAuthorizationFailedError, KafkaError, KafkaTimeoutError, TopicAuthorizationFailedError

from billing.errors import LedgerError, LedgerRecordError, LedgerSchemaError
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from consumer.config import KafkaConfig
from consumer.ledger_calls import LedgerCalls
from consumer.metrics import UNREGISTERED, WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import DlqRecord, ErrorInfo, Result, dlq_raw_limit, dlq_record
from consumer.spool import Spool, encode_record
from consumer.spool_flush import _BACKOFF_MAX_S, SpoolFlush, _writer
from consumer.stages import StageLog, Stamps

log = logging.getLogger("lorabatch.worker")

_ENVELOPE_BYTES = 1024  # key, headers and record overhead kept free under kafka.max_message_bytes
# Answers waiting this long with none published or delivered meanwhile: the broker does not take them (dead, frozen,
# unreachable; or the spool's disk is full). aiokafka fails a send to a dead broker only at its request timeout (40 s),
# so the outbox's own progress says it first.
STALL_S = 5.0


@dataclass
class Outcome:
    """What one message produced; delivered before its offset counts as done."""

    tp: TopicPartition
    offset: int
    result: Result | None = None
    usage: UsageRecord | None = None
    dlq: DlqRecord | None = None
    epoch: int | None = None  # the partition epoch its offset belongs to (consumer/offsets.py)
    sent: set[str] = dataclasses.field(default_factory=set)  # "result", "dlq": what the broker has taken
    replaced: bool = False  # the result was swapped for a small failed one (too large or refused)
    stamps: Stamps | None = None  # the job's way through the worker (consumer.stages), for a job the engine ran
    body: bytes | None = None  # the result as JSON, made once for both the broker and the ledger row (`_fit`)

    @property
    def published(self) -> bool:
        return (self.result is None or "result" in self.sent) and (self.dlq is None or "dlq" in self.sent)


# Refusals of the worker itself, not of one message: a topic or cluster ACL without WRITE for its principal. Every
# message would be refused alike until an operator grants it, so they are waited for as a broker that is away is;
# taken as one message's refusal, each result was replaced by a failed one, that too refused and dropped, its job
# billed as failed and its offset committed: a missing grant consumed the whole topic for nothing.
_NOT_ALLOWED = (TopicAuthorizationFailedError, ClusterAuthorizationFailedError)


def _retriable(e: BaseException) -> bool:
    return (isinstance(e, (KafkaTimeoutError, OSError, *_NOT_ALLOWED))
            or isinstance(e, KafkaError) and bool(e.retriable))


class SpoolUnavailable(Exception):
    """Records could reach neither the ledger nor the spool while the worker stops: delivery gives up on the outcomes
    they belong to, which stay uncommitted (their jobs are redelivered to the partitions' next owner)."""


class Deliverer(SpoolFlush):
    def __init__(self, kafka: KafkaConfig, producer: AIOKafkaProducer, ledger, offsets: OffsetTracker,
                 metrics: WorkerMetrics, worker_id: str, known_tenant: Callable[[str], bool], spool: Spool,
                 flush_s: float = 1.0, stages: StageLog | None = None, ledger_calls: LedgerCalls | None = None,
                 gpu_kind: str | None = None):
        """`ledger_calls`: how the ledger is called (off the loop, bounded; consumer.ledger_calls), shared with the
        worker's other ledger calls so that a hung server holds their threads once. `gpu_kind`: the worker's
        ledger.gpu_kind, stamped on every usage record it emits (its price list prices the row)."""
        self.k = kafka
        self.producer = producer
        self.ledger = ledger
        self.ledger_calls = ledger_calls or LedgerCalls()
        self.offsets = offsets
        self.metrics = metrics
        self.worker_id = worker_id
        self.gpu_kind = gpu_kind
        self.known_tenant = known_tenant
        self.spool = spool
        self.flush_s = flush_s
        self.stages = stages
        self.outbox: list[Outcome] = []
        self._event = asyncio.Event()
        self.ledger_down: str | None = None  # why the ledger cannot take writes now; None when it can
        self.schema_behind = False  # the ledger's schema is missing or old: the worker holds its fetching
        self.published = 0  # results the broker has taken
        self._moved_at = time.monotonic()  # when an outcome's message was last published or a batch delivered
        self.spooled = 0  # ledger records written to the spool
        # Set when the worker stops: a spool that cannot be written (a full disk) is then given up on at once, where
        # waiting for space outlasted every stop deadline (SIGTERM ignored for minutes); `gave_up` once it was.
        self.stopping = False
        self.gave_up = False
        self.spool_down: str | None = None  # why the last write to the spool failed (its disk full); None when it took it
        self._spool_down_at = 0.0  # monotonic, when it first failed
        self.flush_failing: str | None = None  # why the flusher cannot read or empty the spool now; None when it can
        self.metrics.spool_records.set(spool.known)

    def emit(self, outcome: Outcome) -> None:
        if outcome.usage is not None and outcome.usage.gpu_kind is None:
            outcome.usage = dataclasses.replace(outcome.usage, gpu_kind=self.gpu_kind)
        if not self.outbox:
            self._moved_at = time.monotonic()  # an empty outbox had nothing to wait for
        self.outbox.append(outcome)
        self._event.set()

    def stalled_for(self) -> float:
        """How long answers have waited with none of them published or delivered (0 while the outbox is empty)."""
        return time.monotonic() - self._moved_at if self.outbox else 0.0

    async def run(self) -> None:
        while True:
            await self._event.wait()
            self._event.clear()
            if not self.outbox:
                continue
            batch = self.outbox[:]  # stays in the outbox until delivered, so a drain waits for it
            try:
                await self.deliver(batch)
            except SpoolUnavailable as e:
                log.error("stopping: %s; %d outcomes left undelivered and uncommitted, for the partitions' next owner", e,
                          len(self.outbox))
                self.gave_up = True
                return
            except Exception:  # noqa: BLE001 - one outcome our code cannot handle must not stop the others
                log.exception("delivering %d outcomes failed; delivering them one by one", len(batch))
                for o in batch:
                    await self._deliver_alone(o)
            del self.outbox[: len(batch)]

    async def drain(self, stall_s: float | None = None) -> bool:
        """Wait until everything emitted so far is delivered; with `stall_s`, no longer than the broker goes that long
        taking none of it (a dead broker: what is left stays unpublished, unbilled and uncommitted). Whether it was."""
        self._event.set()
        while self.outbox and not self.gave_up:
            if stall_s is not None and self.stalled_for() >= stall_s:
                return False
            await asyncio.sleep(0.01)
        return not self.outbox

    async def leave_to_the_next_owner(self) -> None:
        """At a stop that gave up on the broker, with the run task ended: bill what of the batch in flight it took
        (`bill_published`), and say what is left for the partitions' next owner."""
        stalled = self.stalled_for()
        taken = await self.bill_published()
        log.warning("stopping: %d answers not published, none for %.0f s (is the broker up?); their jobs are not billed "
                    "and stay uncommitted: they are redelivered to the partitions' next owner%s", len(self.outbox), stalled,
                    f" ({taken} answers of the batch in flight that it took are billed)" if taken else "")

    async def bill_published(self, within_s: float = STALL_S) -> int:
        """At a stop that gave up on the broker (`drain` returned False and the run task is ended): bill the outcomes
        of the batch in flight whose messages the broker took before it went away, and mark them done; what the ledger
        does not take is spooled. A batch is billed once all of it is published, so a broker that stopped answering
        mid-batch (frozen: the sends wait for its acknowledgements) left the answers it had taken unbilled: results
        the tenants had, and this worker counted as published, with no row. Their next owner runs them again (they
        stay uncommitted while the broker is away) and writes no second row: the ledger keeps one a request.
        An outcome with nothing to send (a message read again, its answer another outcome's) is left too: its answer
        may be one the broker did not take, and under the epoch of the read again it alone would commit the offset.
        Within `within_s`: a record the ledger refuses goes to the DLQ, through the broker that is away. Returns how
        many were billed."""
        done = [o for o in self.outbox if o.published and o.sent]
        if not done:
            return 0
        billed = [o.usage for o in done if o.usage is not None]
        try:
            async with asyncio.timeout(within_s):
                await self.write(billed)
        except (SpoolUnavailable, TimeoutError) as e:
            why = e if isinstance(e, SpoolUnavailable) else f"not written within {within_s:g} s"
            log.error("stopping: %d answers the broker took are not billed (%s); their jobs stay uncommitted", len(done), why)
            return 0
        for o in done:
            self.offsets.finished(o.tp, o.offset, o.epoch)
            if o.result is not None:
                self._count(o.result)
        self.outbox[:] = [o for o in self.outbox if all(o is not d for d in done)]
        return len(done)

    async def deliver(self, batch: list[Outcome]) -> None:
        for o in batch:
            self._fit(o)
        await self._publish(batch)
        billed = [o.usage for o in batch if o.usage is not None]
        if billed:
            await self.write(billed)
        self._moved_at = time.monotonic()
        for o in batch:
            self.offsets.finished(o.tp, o.offset, o.epoch)
            if o.stamps is not None and self.stages is not None:
                self.stages.billed(o.tp, o.offset, o.stamps)
            if o.result is not None:
                self._count(o.result)

    async def _deliver_alone(self, o: Outcome) -> None:
        """Deliver one outcome; one that still fails is replaced by a DLQ record of its position and why."""
        try:
            await self.deliver([o])
            return
        except SpoolUnavailable:
            raise  # not this outcome's fault: it stays undelivered, not dead-lettered
        except Exception as e:  # noqa: BLE001
            log.exception("outcome of %s:%s@%s cannot be delivered; a DLQ record goes out instead", o.tp.topic,
                          o.tp.partition, o.offset)
            error = ErrorInfo(code="undeliverable", message=f"the worker could not deliver this message's outcome "
                              f"({type(e).__name__}); it was logged")
        self.metrics.undeliverable.inc()
        # Its identity, so that `lorabatch results` accounts for the job (without it, it waited out its --timeout).
        of = o.result or o.dlq
        ids = {k: getattr(of, k, None) for k in ("request_id", "tenant_id", "batch_id")}
        dead = Outcome(o.tp, o.offset, dlq=DlqRecord(error=error, source_topic=o.tp.topic, source_partition=o.tp.partition,
                                                     source_offset=o.offset, raw="", raw_b64="", worker_id=self.worker_id, **ids),
                       epoch=o.epoch)
        try:
            await self.deliver([dead])
        except SpoolUnavailable:
            raise
        except Exception:  # noqa: BLE001 - nothing smaller exists: the offset moves on, loudly
            log.exception("not even a DLQ record could be delivered for %s:%s@%s", o.tp.topic, o.tp.partition, o.offset)
            self.offsets.finished(o.tp, o.offset, o.epoch)

    # ---------------------------------------------------------------- publish

    def _limit(self) -> int:
        return self.k.max_message_bytes - min(_ENVELOPE_BYTES, self.k.max_message_bytes // 8)

    def _fit(self, o: Outcome) -> None:
        """Make the outcome's messages fit the broker, and keep the result body with its usage row."""
        if o.result is not None and not o.published:
            body = o.result.model_dump_json().encode()
            if len(body) > self._limit():
                self._undeliverable(o, body, "result_too_large", f"the result is {len(body)} bytes, over "
                                    f"kafka.max_message_bytes={self.k.max_message_bytes}; ask for fewer max_new_tokens or logprobs")
                body = o.result.model_dump_json().encode()
            o.body = body
            if o.usage is not None:
                o.usage = dataclasses.replace(o.usage, result_json=body.decode())
        if o.dlq is not None and len(o.dlq.model_dump_json()) > self._limit():
            o.dlq = o.dlq.model_copy(update={"raw": "", "raw_b64": "", "raw_truncated": True})

    def _undeliverable(self, o: Outcome, body: bytes, code: str, why: str) -> None:
        """Replace a result the broker cannot take by a small failed one; its body goes to the DLQ, cut to size."""
        r = o.result
        assert r is not None
        error = ErrorInfo(code=code, message=why)
        o.result = r.model_copy(update={"status": "failed", "text": "", "output_ids": [], "logprobs": None, "finish_reason": None,
                                        "error": error})  # fmt: skip
        o.replaced = True
        o.body = o.result.model_dump_json().encode()  # the small result: what the broker is sent and the row keeps
        o.dlq = dlq_record(body, error, topic=self.k.results_topic, partition=o.tp.partition, offset=o.offset,
                           timestamp_ms=None, worker_id=self.worker_id, max_bytes=self.k.max_message_bytes,
                           request_id=r.request_id, tenant_id=r.tenant_id, batch_id=r.batch_id)
        if o.usage is not None:  # the GPU time was spent: the row keeps it, with the status and body the tenant saw
            o.usage = dataclasses.replace(o.usage, status="failed", error_code=code, result_json=o.body.decode())
        self.metrics.dead_letter(code)
        log.error("result of %s/%s is undeliverable (%s); a failed result and a DLQ record go out instead",
                  r.tenant_id, r.request_id, why)

    async def _publish(self, batch: list[Outcome]) -> None:
        delay = 0.1
        started = time.monotonic()
        while todo := [o for o in batch if not o.published]:
            sent = await asyncio.gather(*(self._send(o) for o in todo), return_exceptions=True)
            waiting: BaseException | None = None
            for o, err in zip(todo, sent):
                if err is None:
                    continue
                if isinstance(err, asyncio.CancelledError):
                    raise err
                if _retriable(err):
                    if not isinstance(waiting, _NOT_ALLOWED):  # the line names a refusal first: it has a fix
                        waiting = err
                elif o.replaced or o.result is None or "result" in o.sent:
                    # Even the small form (or a bounded DLQ record) was refused: nothing smaller can be sent.
                    o.sent.update(("result", "dlq"))
                    self.metrics.undeliverable.inc()
                    log.error("the broker refused the %s of %s:%s@%s (%s); it is dropped",
                              "result" if o.result else "DLQ record", o.tp.topic, o.tp.partition, o.offset, err)
                else:
                    body = o.result.model_dump_json().encode()
                    self._undeliverable(o, body, "result_undeliverable", f"the broker refused the result: {err}")
            if waiting is not None:
                self.metrics.waiting.labels("broker").set(1)
                self.metrics.retries.labels("publish").inc()
                topics = self._topics_of(todo)
                fix = ("" if not isinstance(waiting, _NOT_ALLOWED) else
                       f": the broker does not let this worker write to {topics}; grant its principal WRITE on {topics} (and "
                       f"DESCRIBE)" if isinstance(waiting, TopicAuthorizationFailedError) else
                       f": the broker refuses this worker's writes at the cluster; grant its principal IDEMPOTENT_WRITE on the "
                       f"cluster (Kafka asks it of producers it takes as idempotent), and WRITE and DESCRIBE on {topics}")
                log.warning("waiting for the broker to publish %d outcomes to %s for %.0fs (%s%s); retrying in %.1fs",
                            len([o for o in batch if not o.published]), topics, time.monotonic() - started,
                            waiting, fix, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
        self.metrics.waiting.labels("broker").set(0)

    def _topics_of(self, todo: list[Outcome]) -> str:
        """The topics the outcomes still to send go to: a results or DLQ topic the cluster lacks (auto-creation off) is
        the usual cause of a wait that never ends, and the line names it."""
        topics = {self.k.results_topic for o in todo if o.result is not None and "result" not in o.sent}
        topics |= {self.k.dlq_topic for o in todo if o.dlq is not None and "dlq" not in o.sent}
        return ", ".join(sorted(topics)) or self.k.results_topic

    async def _send(self, o: Outcome) -> None:
        """Send what of the outcome the broker has not taken yet; each part is sent once."""
        if o.result is not None and "result" not in o.sent:
            key = o.result.request_id.encode()
            body = o.body if o.body is not None else o.result.model_dump_json().encode()
            await (await self.producer.send(self.k.results_topic, body, key=key))
            o.sent.add("result")
            self._moved_at = time.monotonic()
            if o.stamps is not None:
                o.stamps.published = time.monotonic_ns()
            self.published += 1
        if o.dlq is not None and "dlq" not in o.sent:
            await (await self.producer.send(self.k.dlq_topic, o.dlq.model_dump_json().encode()))
            o.sent.add("dlq")
            self._moved_at = time.monotonic()

    # ---------------------------------------------------------------- bill

    async def write(self, records: Sequence[UsageRecord | BusyRecord | AdapterLoadRecord]) -> None:
        """Write records of one kind to the ledger, or spool them when it cannot take them now."""
        if not records:
            return
        if self.ledger_down is not None and self.spool.known:  # keep their order behind what already waits
            await self._spool(records)
            return
        try:
            await self.ledger_calls(_writer(self.ledger, records[0]), records)
        except LedgerRecordError:
            await self._one_by_one(records)
        except LedgerError as e:
            self._down(e)
            await self._spool(records)
        except Exception as e:  # noqa: BLE001 - an unmapped database failure: keep the records, say so
            log.exception("ledger write of %d %s failed unexpectedly; spooled", len(records), type(records[0]).__name__)
            self._down(e)
            await self._spool(records)
        else:
            self._up()

    async def _one_by_one(self, records: Sequence) -> None:
        """The ledger refused a batch for a bad record: write the others, send the refused ones to the DLQ."""
        for r in records:
            try:
                await self.ledger_calls(_writer(self.ledger, r), [r])
            except LedgerRecordError as e:
                await self._refused(r, e)
            except LedgerError as e:
                self._down(e)
                await self._spool([r])

    async def _refused(self, r, e: Exception) -> None:
        body = _refused_body(r, dlq_raw_limit(self.k.max_message_bytes))
        record = dlq_record(body, ErrorInfo(code="ledger_rejected", message=str(e)), topic="ledger", partition=-1,
                            offset=-1, timestamp_ms=None, worker_id=self.worker_id, max_bytes=self.k.max_message_bytes,
                            request_id=getattr(r, "request_id", None), tenant_id=getattr(r, "tenant_id", None),
                            batch_id=getattr(r, "batch_id", None))
        log.error("ledger refused %s: %s; sent to the DLQ", type(r).__name__, e)
        self.metrics.dead_letter("ledger_rejected")
        dead = Outcome(TopicPartition("ledger", -1), -1, dlq=record)
        await self._publish([dead])

    async def _spool(self, records: Sequence) -> None:
        """Keep records the ledger did not take in the spool. A spool that cannot be written (its disk full) is waited
        for, with the ledger tried again at each retry (it may come back first); said once when it starts, once when
        it ends, and by `lorabatch_spool_up` meanwhile: one line per retry and writer (the GPU-time records' too) filled
        the log, and `lorabatch_ledger_up` alone said nothing of it."""
        delay = 0.1
        while True:
            try:
                await asyncio.to_thread(self.spool.put, records)
            except Exception as e:  # noqa: BLE001 - a full disk: nothing can be done but wait and say so
                if self.stopping:
                    raise SpoolUnavailable(f"{len(records)} records reach neither the ledger nor the spool at "
                                           f"{self.spool.path} ({e})") from e
                self._spool_failed(e)
                self.metrics.retries.labels("spool").inc()
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                if await self._ledger_took(records):
                    break
                continue
            self.spooled += len(records)
            self._spool_ok()
            break
        self.metrics.waiting.labels("spool").set(0)
        self.metrics.spool_records.set(self.spool.known)

    async def _ledger_took(self, records: Sequence) -> bool:
        """Whether the ledger took records the spool could not (it came back while the spool's disk stayed full)."""
        try:
            await self.ledger_calls(_writer(self.ledger, records[0]), records)
        except LedgerRecordError:
            await self._one_by_one(records)
        except Exception as e:  # noqa: BLE001 - still down (or unmapped: the spool's retry keeps them meanwhile)
            self._down(e)
            return False
        else:
            self._up()
        return True

    def _spool_failed(self, e: Exception) -> None:
        if self.spool_down is None:
            self._spool_down_at = time.monotonic()
            log.error("the spool at %s cannot be written (%s) and the ledger is away: ledger records can be neither "
                      "written nor kept; delivery waits, and fetching pauses, until there is space on the spool's disk or "
                      "the ledger returns (said once; lorabatch_spool_up is 0 until then)", self.spool.path, e)
        self.spool_down = str(e)
        self.metrics.spool_up.set(0)
        self.metrics.waiting.labels("spool").set(1)

    def _spool_ok(self) -> None:
        if self.spool_down is not None:
            log.warning("the spool at %s takes writes again, %.0f s after it stopped", self.spool.path,
                        time.monotonic() - self._spool_down_at)
        self.spool_down = None
        self.metrics.spool_up.set(1)

    def _down(self, e: Exception) -> None:
        schema = isinstance(e, LedgerSchemaError)
        if self.ledger_down is None or schema != self.schema_behind:
            if schema:
                log.error("THE LEDGER'S SCHEMA IS MISSING OR BEHIND: %s. The worker holds new jobs and spools records "
                          "to %s until it is migrated.", e, self.spool.path)
            else:
                log.error("the ledger is unavailable (%s); records are spooled to %s until it returns", e, self.spool.path)
        self.ledger_down = str(e)
        self.schema_behind = schema
        self.metrics.ledger_up.set(0)
        self.metrics.ledger_schema_ok.set(0 if schema else 1)

    def _up(self) -> None:
        if self.ledger_down is not None:
            log.warning("the ledger takes writes again; %d spooled records to flush", self.spool.known)
        self.ledger_down = None
        self.schema_behind = False
        self.metrics.ledger_up.set(1)
        self.metrics.ledger_schema_ok.set(1)

    def _count(self, r: Result) -> None:
        tenant = r.tenant_id if self.known_tenant(r.tenant_id) else UNREGISTERED
        adapter = r.adapter or ("base" if r.route.startswith("base_fallback") else "none")
        self.metrics.requests.labels(tenant, adapter, r.status).inc()
        if r.status == "succeeded":
            self.metrics.duration.labels(tenant).observe(r.timings.total_ms / 1000)
            self.metrics.routing_cost.labels(tenant).inc(r.cost.routing_ms)
            self.metrics.lora_cost.labels(tenant).inc(r.cost.lora_ms)


def _refused_body(r, limit: int) -> bytes:
    """The DLQ body of a record the ledger refused: the whole record, `{"kind": ..., "record": {every field}}`, so that
    finance can bill it again exactly (created_at, gpu_kind, tier, worker_id, the costs); the body held the answer
    (`result_json`) alone. Where it is over what a DLQ record keeps (`limit` bytes), the answer, published already in
    the results topic, is left out (`result_json_left_out`: its size and sha256), rather than the body's tail cut."""
    kind, fields = encode_record(r)
    out = {"kind": kind, "record": json.loads(fields)}
    body = json.dumps(out).encode()
    answer = out["record"].get("result_json")
    if len(body) > limit and answer:
        answer = answer.encode()
        out["record"]["result_json"] = None
        out["result_json_left_out"] = {"bytes": len(answer), "sha256": hashlib.sha256(answer).hexdigest()}
        body = json.dumps(out).encode()
    return body
