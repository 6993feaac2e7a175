"""Intake: a fetched message's way to the fair scheduler, or straight to its answer.

Each fetched message is parsed, then, by its request identity (tenant_id, request_id):
- answered from what is stored when it was answered before (in memory, the spool or the ledger);
- parked as a copy when the same key is queued or running here (it gets the first one's answer);
- dead-lettered when it cannot be read as a job, or stands for a record batch that could not be decoded
  (one DLQ record naming its offsets; the offsets commit past it);
- failed at once when it is invalid but addressable, or cannot be routed;
- otherwise routed (one cache round trip for the whole fetch) and queued in the scheduler.
The same message read twice (a rejoin after a broker restart) counts as done without a second answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from datetime import UTC, datetime
from types import SimpleNamespace

from aiokafka import TopicPartition

from consumer.answers import Copy, Key, answer_bytes, key_of, stored_result
from consumer.config import Settings
from consumer.delivery import Deliverer, Outcome
from consumer.feeder import Routed
from consumer.ledger_calls import LedgerCalls
from consumer.logs import Repeats, Throttle
from consumer.metrics import WorkerMetrics
from consumer.outcomes import failed_before_engine
from consumer.registry import RegistrySnapshot
from consumer.routing import RouteError, Router
from consumer.rules import RuleClassifier
from consumer.scheduler import Pending, Scheduler
from consumer.schemas import ErrorInfo, Job, Rejection, Result, dlq_record, parse_job
from consumer.spool import Spool
from consumer.stages import Stamps
from consumer.undecodable import undecodable
from engine.config import EngineConfig

log = logging.getLogger("lorabatch.worker")

# Answers kept in memory: worker.answered_cache of them, and that many times ANSWER_BYTES in all (10,000: 164 MB), the
# oldest going first; an answer over 4 x ANSWER_BYTES is not kept (a resend reads it back from the spool or the ledger)
ANSWER_BYTES = 16_384


def message_bytes(m) -> int:
    """A record's size as `lorabatch submit` measures the message it sends: its key and value, and here its headers too
    (a producer that is not ours can send a megabyte of either beside a small value)."""
    headers = sum(_size(k) + _size(v) for k, v in (getattr(m, "headers", None) or ()))
    return len(m.value or b"") + len(m.key or b"") + headers


def _size(part: str | bytes | None) -> int:
    """A header key (str, decoded from UTF-8 by aiokafka) or value in bytes: a key of emoji counted a quarter of its
    length in characters."""
    if part is None:
        return 0
    return len(part.encode("utf-8", "surrogatepass")) if isinstance(part, str) else len(part)


class Intake:
    def __init__(self, settings: Settings, metrics: WorkerMetrics, worker_id: str, scheduler: Scheduler, router: Router,
                 spool: Spool, ledger, work_event: asyncio.Event, snapshot: RegistrySnapshot, *,
                 ledger_calls: LedgerCalls | None = None):
        self.s = settings
        self.metrics = metrics
        self.worker_id = worker_id
        self.scheduler = scheduler
        self.router = router
        self.spool = spool
        self.ledger = ledger
        self.ledger_calls = ledger_calls or LedgerCalls()  # bounded: a hung ledger must not hold the fetch loop
        self.work_event = work_event
        self.deliverer: Deliverer | None = None  # set once the worker's producer exists
        self.use(snapshot)
        self.running: dict[Key, list[Copy]] = {}  # keys queued or in the engine here, with their waiting copies
        # The copies waiting in `running`, and their tokens: queued work as the worker's backpressure counts it (a producer
        # resending one request id while it waits for its quota parked 6,000 copies with fetching never paused)
        self.parked = self.parked_tokens = 0
        self.answers: OrderedDict[Key, Result] = OrderedDict()  # recent answers, newest last (bounded)
        self.answers_bytes = 0  # what they take (consumer.answers.answer_bytes)
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # recent messages read, by position and timestamp
        self._lookup_throttle = Throttle(30.0)  # a line about stored answers the ledger cannot give, every 30 s at most
        self.dlq_log = Repeats("DLQ records", log)  # the DLQ topic has each record: the log has a line every 10 s at most

    def use(self, snapshot: RegistrySnapshot) -> None:
        """Route by this registry snapshot from now on."""
        old = getattr(self, "classifier", None)
        if isinstance(old, RuleClassifier) and old.rules == snapshot.rules:
            self.snapshot = snapshot  # the same rules: the classifier stays, with the slow rules it skips
            return
        self.snapshot = snapshot
        self.classifier = RuleClassifier(snapshot.rules)

    def tier_of(self, tenant_id: str | None) -> str | None:
        """The tenant's tier in the snapshot routed by now (its rows' token price list); None when it is not registered."""
        tenant = self.snapshot.tenants.get(tenant_id) if tenant_id is not None else None
        return tenant.tier if tenant is not None else None

    def parse(self, m) -> Job | Rejection:
        if (batch := undecodable(m)) is not None:
            return Rejection(ErrorInfo(code="undecodable_batch", message=batch.describe()), False)
        if (size := message_bytes(m)) > self.s.kafka.max_message_bytes:
            return Rejection(ErrorInfo(
                code="message_too_large", message=f"{size} bytes (key, value and headers) exceeds kafka.max_message_bytes="
                f"{self.s.kafka.max_message_bytes}; send a shorter prompt, key or headers"), False)
        try:
            return parse_job(m.value)
        except Exception as e:  # noqa: BLE001 - whatever a message does to the parser, it is that message's fault
            log.exception("parsing %s:%s@%s failed", m.topic, m.partition, m.offset)
            return Rejection(ErrorInfo(code="unprocessable", message=f"the message could not be read as a job "
                                       f"({type(e).__name__}); send one JSON job object"), False)

    async def ingest(self, items: list[tuple[TopicPartition, object, int]], fetched_ns: int | None = None) -> None:
        """Answer, park, dead-letter or queue each fetched (partition, message, epoch); `fetched_ns`: when the fetch
        that brought them returned (monotonic; consumer.stages)."""
        now = datetime.now(UTC)
        fetched_ns = fetched_ns or time.monotonic_ns()
        parsed_items = [(tp, m, epoch, self.parse(m)) for tp, m, epoch in items]
        fresh = {k for *_, p in parsed_items if (k := key_of(p)) is not None and k not in self.running and k not in self.answers}
        stored = await self.stored(fresh)
        looked_up_ns = time.monotonic_ns()
        jobs: list[tuple[TopicPartition, int, int, Job]] = []
        for tp, m, epoch, parsed in parsed_items:
            try:
                # The same message read again (the group rejoined after a broker restart, say) was answered
                # already: its offset counts as done without a second result or DLQ record.
                again = self._seen_message((tp.topic, tp.partition, m.offset, m.timestamp))
                key = key_of(parsed)
                if key is None:
                    if again:
                        self.deliverer.emit(Outcome(tp, m.offset, epoch=epoch))
                    else:
                        self.dead_letter(tp, m, epoch, parsed)
                elif key in self.running:
                    self._park(key, [Copy(tp, m.offset, epoch, parsed, silent=again)])
                elif (answer := self.answers.get(key)) is not None or (answer := stored.get(key)) is not None:
                    self.metrics.replays.labels("redelivered" if again else "memory" if key in self.answers else "ledger").inc()
                    self.deliverer.emit(Outcome(tp, m.offset, result=None if again else answer, epoch=epoch))
                elif isinstance(parsed, Rejection):
                    self.reject(tp, m.offset, epoch, parsed, now)
                else:
                    self.running[key] = []
                    jobs.append((tp, m.offset, epoch, parsed))
            except Exception as e:  # noqa: BLE001 - a bug on our side: this message alone goes to the DLQ
                log.exception("ingesting %s:%s@%s failed", tp.topic, tp.partition, m.offset)
                self.dead_letter(tp, m, epoch, Rejection(ErrorInfo(
                    code="unprocessable", message=f"the worker failed on this message ({type(e).__name__}); it was logged"), False))
        await self.admit(jobs, now, (fetched_ns, looked_up_ns))

    async def admit(self, jobs: list[tuple[TopicPartition, int, int, Job]], now: datetime,
                    fetch_stamps: tuple[int, int] | None = None) -> None:
        """Route jobs (one cache round trip) and queue them in the fair scheduler; `fetch_stamps`: (fetched, looked up)
        in monotonic ns (consumer.stages), now when absent (a parked copy taking its first's place)."""
        if not jobs:
            return
        fetched_ns, looked_up_ns = fetch_stamps or (time.monotonic_ns(),) * 2
        try:
            routes = await self.router.route_batch(self.snapshot, self.classifier, [j for *_, j in jobs])
        except Exception as e:  # noqa: BLE001 - routing must not lose the batch: each job fails on its own
            log.exception("routing %d jobs failed", len(jobs))
            routes = [RouteError("routing_failed", f"routing failed ({type(e).__name__}); it was logged, and the same "
                                 "request_id may be sent again", retriable=True) for _ in jobs]  # fmt: skip
        # The engine counts a request's queue time from this arrival (consumer.stages' `queue` stage starts here too).
        queued_ns = time.monotonic_ns()
        mono_us = queued_ns // 1000
        for (tp, offset, epoch, job), route in zip(jobs, routes):
            if isinstance(route, RouteError):
                # A failure of ours (routing_failed) is not an answer to keep: nothing ran, and a resend may route.
                self.fail(tp, offset, epoch, job, route.info, now, route.info.code, keep=route.info.code != "routing_failed")
                continue
            self.metrics.route(route.reason)
            self.metrics.route_decision.observe(route.routing_us / 1e6)
            tokens = estimate_tokens(job, self.s.engine)
            if job.on_quota == "fail" and self.scheduler.over_quota(job.tenant_id, tokens):
                t = self.snapshot.tenants[job.tenant_id]
                # Not an answer to keep: nothing ran, so the same request_id may be sent again later.
                self.fail(tp, offset, epoch, job, ErrorInfo(
                    code="quota_exceeded", retriable=True, message=f"tenant {job.tenant_id!r} is over its rate limit "
                    f"({_limit(t.requests_per_minute)} requests, {_limit(t.tokens_per_minute)} tokens per "
                    f"minute); retry later, or send on_quota=\"wait\" to queue instead"), now, route.label, keep=False)
                continue
            item = Routed(job, route, tp, offset, now, mono_us, epoch=epoch,
                          stamps=Stamps((job.tenant_id, job.request_id), fetched_ns, looked_up_ns, queued_ns),
                          tier=self.tier_of(job.tenant_id))
            self.scheduler.push(Pending(job.tenant_id, route.view.adapter_key if route.view else None, tokens,
                                        time.monotonic(), item, partition=tp, priority=job.priority))
        self.work_event.set()

    async def stored(self, keys: set[Key]) -> dict[Key, Result]:
        """Answers already given to these keys: in the spool (not yet in the ledger) or in the ledger."""
        if not keys:
            return {}
        found: dict[Key, Result] = {}
        try:
            for key, usage in (await asyncio.to_thread(self.spool.usage, keys)).items():
                found[key] = stored_result(key, usage.result_json, usage)
        except Exception:  # noqa: BLE001 - the spool file is unreadable: the ledger may still know
            log.exception("cannot read stored answers from the spool at %s", self.spool.path)
        rest = keys - found.keys()
        try:
            if rest:
                for key, row in (await self.ledger_calls(self.ledger.answered, rest)).items():
                    found[key] = stored_result(key, row.result_json, row)
        except Exception as e:  # noqa: BLE001 - down, behind its schema: going by what this worker knows
            # Answers written by this worker are in memory or the spool; another worker's, written while the
            # ledger is away, cannot be seen: such a copy runs again and is billed once (the ledger's key).
            if self._lookup_throttle.due():
                log.warning("cannot ask the ledger for stored answers (%s); going by this worker's own", e)
        return found

    def _seen_message(self, message_id: tuple) -> bool:
        """Whether this worker read this very message (topic, partition, offset, timestamp) before; note it."""
        seen = message_id in self._seen
        self._seen[message_id] = None
        self._seen.move_to_end(message_id)
        while len(self._seen) > 2 * self.s.worker.answered_cache:
            self._seen.popitem(last=False)
        return seen

    def _park(self, key: Key, copies: list[Copy]) -> None:
        self.running[key].extend(copies)
        self.parked += len(copies)
        self.parked_tokens += sum(estimate_tokens(c.parsed, self.s.engine) for c in copies if isinstance(c.parsed, Job))

    def _unpark(self, key: Key) -> list[Copy]:
        """The key's first message is answered or left: it leaves `running`, with the copies that waited for it."""
        copies = self.running.pop(key, [])
        self.parked -= len(copies)
        self.parked_tokens -= sum(estimate_tokens(c.parsed, self.s.engine) for c in copies if isinstance(c.parsed, Job))
        return copies

    def answer(self, key: Key, outcome: Outcome, *, keep: bool = True) -> None:
        """Emit the answer to a key's first message, then the same answer to every copy that waited for it. It is kept
        in memory for a resend only when it is stored too (it has a usage row): an answer that only this worker kept
        (unknown_tenant, whose tenant nobody bills) was replayed here after the tenant was registered, while any other
        worker, or this one restarted, ran the resent job."""
        self.deliverer.emit(outcome)
        result = outcome.result
        assert result is not None, outcome
        if keep and outcome.usage is not None and self.s.worker.answered_cache:
            self._keep(key, result)
        for c in self._unpark(key):
            self.metrics.replays.labels("redelivered" if c.silent else "waited").inc()
            self.deliverer.emit(Outcome(c.tp, c.offset, result=None if c.silent else result, epoch=c.epoch))

    def _keep(self, key: Key, result: Result) -> None:
        """Keep an answer for a resend, within worker.answered_cache answers and that many times ANSWER_BYTES."""
        size = answer_bytes(result)
        if size > 4 * ANSWER_BYTES or result.logprobs is not None:  # big answers are read back from the spool or the ledger
            return
        if (old := self.answers.pop(key, None)) is not None:
            self.answers_bytes -= answer_bytes(old)
        self.answers[key] = result
        self.answers_bytes += size
        cap = self.s.worker.answered_cache
        while len(self.answers) > cap or self.answers_bytes > cap * ANSWER_BYTES:
            _, gone = self.answers.popitem(last=False)
            self.answers_bytes -= answer_bytes(gone)

    def fail(self, tp: TopicPartition, offset: int, epoch: int, job: Job, error: ErrorInfo, now: datetime, reason: str,
             keep: bool = True) -> None:
        if error.code not in ("quota_exceeded",):
            self.metrics.route(error.code)
        result, usage = failed_before_engine((job.request_id, job.tenant_id, job.batch_id), error, now, self.worker_id,
                                             route_reason=reason, bill=keep and job.tenant_id in self.snapshot.tenants,
                                             tier=self.tier_of(job.tenant_id))
        self.answer((job.tenant_id, job.request_id), Outcome(tp, offset, result=result, usage=usage, epoch=epoch), keep=keep)

    def reject(self, tp: TopicPartition, offset: int, epoch: int, rej: Rejection, now: datetime) -> None:
        result, usage = failed_before_engine((rej.request_id, rej.tenant_id, rej.batch_id), rej.error, now,
                                             self.worker_id, bill=rej.tenant_id in self.snapshot.tenants,
                                             tier=self.tier_of(rej.tenant_id))
        self.answer((rej.tenant_id, rej.request_id), Outcome(tp, offset, result=result, usage=usage, epoch=epoch))

    def dead_letter(self, tp: TopicPartition, m, epoch: int, rej: Rejection) -> None:
        record = dlq_record(m.value, rej.error, topic=tp.topic, partition=tp.partition, offset=m.offset,
                            timestamp_ms=m.timestamp, worker_id=self.worker_id, max_bytes=self.s.kafka.max_message_bytes,
                            request_id=rej.request_id, tenant_id=rej.tenant_id, batch_id=rej.batch_id)
        self.metrics.dead_letter(rej.error.code)
        self.dlq_log.note(rej.error.code, f"dlq {tp.topic}:{tp.partition}@{m.offset} {rej.error.message[:300]}")
        self.deliverer.emit(Outcome(tp, m.offset, dlq=record, epoch=epoch))

    def stepped_over(self, tp: TopicPartition, offset: int, epoch: int, fetch_bytes: int) -> None:
        """A record the consumer stepped over without handing it out (larger than one fetch may bring, on a
        broker that does not send an oversized batch whole): dead-lettered by its offset, so its job is not
        lost in silence."""
        why = (f"the record at offset {offset} is larger than one fetch may bring ({fetch_bytes} bytes), so it was "
               f"never read; produce it smaller, or raise kafka.max_message_bytes on the workers above its size")
        self.dead_letter(tp, SimpleNamespace(value=None, offset=offset, timestamp=None), epoch,
                         Rejection(ErrorInfo(code="message_too_large", message=why), False))

    async def orphaned(self, key: Key, revoked: set[TopicPartition]) -> None:
        """The first copy of a key was abandoned (its partition revoked): a copy from a partition still ours
        runs in its place; copies from revoked partitions are left to their new owner."""
        copies = [c for c in self._unpark(key) if c.tp not in revoked]
        if not copies:
            return
        first, *rest = copies
        if isinstance(first.parsed, Rejection):
            self.reject(first.tp, first.offset, first.epoch, first.parsed, datetime.now(UTC))
            for c in rest:
                self.deliverer.emit(Outcome(c.tp, c.offset, result=self.answers.get(key), epoch=c.epoch))
            return
        self.running[key] = []
        self._park(key, rest)
        await self.admit([(first.tp, first.offset, first.epoch, first.parsed)], datetime.now(UTC))


def estimate_tokens(job: Job, engine: EngineConfig) -> int:
    """Tokens a job can occupy, for cutting batches, fair shares and token quotas (the engine counts exactly): at most
    what the engine runs for one request. A job over its limits is refused there having run nothing; counted at its own
    word, max_new_tokens=131072 took that much of its tenant's token quota (13 minutes of a 10,000-a-minute one)."""
    if job.input_ids is not None:
        prompt = len(job.input_ids)
    elif job.prompt is not None:
        prompt = len(job.prompt) // 3 + 1
    else:
        prompt = sum(len(m.content) for m in job.messages) // 3 + 8 * len(job.messages)
    return min(prompt, engine.max_prompt_tokens) + min(job.max_new_tokens, engine.max_new_tokens)


def _limit(per_minute: int) -> int | str:
    """A rate limit as the scheduler serves it: 0, and a negative one a registry row holds, are unlimited."""
    return per_minute if per_minute > 0 else "unlimited"


def stepped_over(e: Exception) -> tuple[TopicPartition, int, int] | None:
    """(partition, offset, fetch size) of the record aiokafka's RecordTooLargeError says it stepped over
    (it moves the position one past it, then raises from getmany once); None for any other error."""
    args = getattr(e, "args", ())
    if type(e).__name__ == "RecordTooLargeError" and len(args) >= 4 and isinstance(args[1], TopicPartition) \
            and isinstance(args[2], int) and isinstance(args[3], int):
        return args[1], args[2], args[3]
    return None
