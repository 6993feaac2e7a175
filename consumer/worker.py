"""The worker: Kafka jobs in, engine batches, results and ledger rows out, offsets committed last.

Four tasks share one event loop:
- fetch: `getmany`, parse, route, and put each job in its adapter's bucket (or answer it at once
  when it cannot run: a DLQ record or a failed result);
- dispatch: cut batches from closed buckets and run them on the engine in its own thread, so the
  loop (and aiokafka's heartbeats) never waits on the GPU;
- deliver: publish results and DLQ records, write ledger rows, then mark the offsets done;
- commit: commit, per partition, the highest contiguous done offset + 1.
A crash anywhere before the commit means redelivery; the ledger's (tenant, request_id) key keeps a
redelivered job from being billed twice.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from billing.errors import LedgerError
from billing.records import AdapterLoadRecord, UsageRecord
from consumer.buckets import AdapterBuckets, Pending
from consumer.config import Settings
from consumer.kafka import make_consumer, make_producer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.outcomes import Served, failed_before_engine, succeeded_or_failed, to_request
from consumer.registry import Registry, RegistrySnapshot
from consumer.routing import Route, RouteError, route
from consumer.schemas import DlqRecord, ErrorInfo, Job, Rejection, Result, parse_job
from engine.api import AdapterError, EngineError, GenerationResult

log = logging.getLogger("lorabatch.worker")


@dataclass
class Outcome:
    """What one message produced; delivered before its offset counts as done."""

    tp: TopicPartition
    offset: int
    result: Result | None = None
    usage: UsageRecord | None = None
    dlq: DlqRecord | None = None
    received_mono: float = 0.0


@dataclass
class Routed:
    job: Job
    route: Route
    tp: TopicPartition
    offset: int
    received_at: datetime
    received_mono_us: int


@dataclass
class BatchOutput:
    outcomes: list[Outcome] = field(default_factory=list)
    loads: list[AdapterLoadRecord] = field(default_factory=list)


class Worker:
    def __init__(self, settings: Settings, engine, registry: Registry, ledger, *, metrics: WorkerMetrics | None = None):
        self.s = settings
        self.engine = engine
        self.registry = registry
        self.ledger = ledger
        self.metrics = metrics or WorkerMetrics()
        self.worker_id = settings.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        w = settings.worker
        self.buckets = AdapterBuckets(w.max_batch_size, w.max_batch_tokens, w.max_wait_ms, w.max_adapters_per_batch)
        self.offsets = OffsetTracker()
        self.outbox: list[Outcome] = []
        self._outbox_event = asyncio.Event()
        self._work_event = asyncio.Event()
        self._stopping = asyncio.Event()
        self._engine_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._snapshot: RegistrySnapshot = registry.snapshot()
        self._snapshot_at = time.monotonic()
        self._running_batch = 0
        self._paused = False
        self.consumer = None
        self.producer = None

    # ---------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask the worker to drain and exit (SIGTERM handler)."""
        self._stopping.set()
        self._work_event.set()

    async def run(self) -> None:
        k = self.s.kafka
        self.producer = make_producer(k, client_id=self.worker_id)
        self.consumer = make_consumer(k, group_id=k.group_id, client_id=self.worker_id, max_poll_records=500)
        self.consumer.subscribe([k.jobs_topic], listener=_Rebalance(self))
        await self.producer.start()
        try:
            await self.consumer.start()
            try:
                await self._run_tasks()
            finally:
                await self._commit()
                await self.consumer.stop()
        finally:
            await self.producer.stop()
            self._engine_pool.shutdown(wait=True)

    async def _run_tasks(self) -> None:
        fetch = asyncio.create_task(self._fetch_loop(), name="fetch")
        dispatch = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        deliver = asyncio.create_task(self._deliver_loop(), name="deliver")
        commit = asyncio.create_task(self._commit_loop(), name="commit")
        tasks = [fetch, dispatch, deliver, commit]
        try:
            # The fetch loop ends on stop; the dispatcher then drains the buckets, the deliverer the outbox.
            done, _ = await asyncio.wait([fetch, dispatch], return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
            await fetch
            await dispatch
            self._outbox_event.set()
            while self.outbox:
                await asyncio.sleep(0.01)
                if deliver.done():
                    deliver.result()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.outbox:  # a last attempt, so that what ran is published and billed
                await self._deliver(self.outbox)
                self.outbox.clear()

    # ---------------------------------------------------------------- fetch

    async def _fetch_loop(self) -> None:
        while not self._stopping.is_set():
            self._backpressure()
            batches = await self.consumer.getmany(timeout_ms=100, max_records=500)
            for tp, messages in batches.items():
                for m in messages:
                    self._ingest(tp, m)
            self._refresh_registry()
            self.metrics.queue_depth.set(len(self.buckets))
            self.metrics.in_flight.set(self.offsets.in_flight())

    def _backpressure(self) -> None:
        over = len(self.buckets) + self._running_batch >= self.s.worker.max_queued_jobs
        assigned = self.consumer.assignment()
        if over and not self._paused and assigned:
            self.consumer.pause(*assigned)
            self._paused = True
        elif not over and self._paused:
            self.consumer.resume(*self.consumer.paused())
            self._paused = False

    def _refresh_registry(self) -> None:
        if time.monotonic() - self._snapshot_at >= self.s.worker.registry_refresh_s:
            self._snapshot_at = time.monotonic()
            try:
                self._snapshot = self.registry.snapshot()
            except Exception:  # the database is away: keep routing on the last snapshot
                log.exception("registry refresh failed; routing on the previous snapshot")

    def _ingest(self, tp: TopicPartition, m) -> None:
        if not self.offsets.fetched(tp, m.offset):
            return  # redelivered after we finished it: already published and billed
        now = datetime.now(UTC)
        if m.value is not None and len(m.value) > self.s.kafka.max_message_bytes:
            parsed: Job | Rejection = Rejection(
                ErrorInfo(code="message_too_large", message=f"{len(m.value)} bytes exceeds kafka.max_message_bytes="
                          f"{self.s.kafka.max_message_bytes}; send a shorter prompt"), False)
        else:
            parsed = parse_job(m.value)
        if isinstance(parsed, Rejection):
            self._reject(tp, m, parsed, now)
            return
        job = parsed
        try:
            r = route(self._snapshot, job)
        except RouteError as e:
            self.metrics.route_decisions.labels(e.info.code).inc()
            known = job.tenant_id in self._snapshot.tenants
            result, usage = failed_before_engine((job.request_id, job.tenant_id, job.batch_id), e.info, now,
                                                 self.worker_id, route_reason=e.info.code, bill=known)
            self._emit(Outcome(tp, m.offset, result=result, usage=usage))
            return
        self.metrics.route_decisions.labels(r.reason).inc()
        item = Routed(job, r, tp, m.offset, now, time.monotonic_ns() // 1000)
        key = r.adapter.key if r.adapter else None
        self.buckets.add(Pending(key, _estimate_tokens(job), time.monotonic(), item, partition=tp))
        self._work_event.set()

    def _reject(self, tp: TopicPartition, m, rej: Rejection, now: datetime) -> None:
        if rej.addressable:
            known = rej.tenant_id in self._snapshot.tenants
            result, usage = failed_before_engine((rej.request_id, rej.tenant_id, rej.batch_id), rej.error, now,
                                                 self.worker_id, bill=known)
            self._emit(Outcome(tp, m.offset, result=result, usage=usage))
            return
        raw = m.value or b""
        record = DlqRecord(
            error=rej.error, source_topic=tp.topic, source_partition=tp.partition, source_offset=m.offset,
            source_timestamp_ms=m.timestamp, raw=raw.decode("utf-8", "replace")[:65536],
            raw_b64=base64.b64encode(raw).decode(), request_id=rej.request_id, tenant_id=rej.tenant_id,
            batch_id=rej.batch_id, worker_id=self.worker_id,
        )
        self.metrics.dlq.labels(rej.error.code).inc()
        log.warning("dlq %s:%s@%s %s", tp.topic, tp.partition, m.offset, rej.error.message)
        self._emit(Outcome(tp, m.offset, dlq=record))

    def _emit(self, outcome: Outcome) -> None:
        self.outbox.append(outcome)
        self._outbox_event.set()

    # ---------------------------------------------------------------- dispatch

    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            stopping = self._stopping.is_set()
            deadline = self.buckets.next_deadline(time.monotonic())
            if deadline is None:
                if stopping:
                    return
                self._work_event.clear()
                await self._work_event.wait()
                continue
            if deadline > 0 and not stopping:
                self._work_event.clear()
                try:
                    await asyncio.wait_for(self._work_event.wait(), timeout=deadline)
                except TimeoutError:
                    pass
                continue
            batch = self.buckets.take_batch(time.monotonic(), force=stopping)
            if not batch:
                continue
            self._running_batch = len(batch)
            try:
                out = await loop.run_in_executor(self._engine_pool, self._execute, [p.payload for p in batch])
            finally:
                self._running_batch = 0
            self.metrics.batches.inc()
            self.metrics.batch_size.observe(len(batch))
            for outcome in out.outcomes:
                self._emit(outcome)
            if out.loads:
                try:
                    await asyncio.to_thread(self.ledger.record_adapter_loads, out.loads)
                except Exception:
                    log.exception("could not record %d adapter loads", len(out.loads))

    def _execute(self, items: list[Routed]) -> BatchOutput:
        """In the engine thread: load the batch's adapters, run it, turn results into outcomes."""
        out = BatchOutput()
        runnable: list[tuple[Routed, str | None, str]] = []
        failed_loads: dict[str, EngineError] = {}
        for item in items:
            a = item.route.adapter
            reason = item.route.reason
            if a is not None and a.key not in failed_loads and not self.engine.has_adapter(a.key):
                try:
                    info = self.engine.load_adapter(a.key, self.registry.store.path(a.sha256))
                except (AdapterError, OSError) as e:
                    err = e if isinstance(e, EngineError) else AdapterError(f"cannot read adapter {a.ref}: {e}", code="adapter_unavailable")
                    failed_loads[a.key] = err
                    log.error("adapter %s failed to load: %s", a.key, err)
                else:
                    self.metrics.cold_start.labels(info.tier).observe(info.load_us / 1000)
                    out.loads.append(AdapterLoadRecord(
                        adapter=a.ref, adapter_sha256=a.sha256, tenant_id=a.tenant_id, tier=info.tier,
                        nbytes=info.nbytes, load_us=info.load_us, worker_id=self.worker_id,
                        created_at=datetime.now(UTC)))
            if a is not None and a.key in failed_loads:
                err = failed_loads[a.key]
                if item.job.allow_base_fallback:
                    runnable.append((item, None, f"{reason}:load_failed:base_fallback"))
                else:
                    info = ErrorInfo(code=err.code, message=f"adapter {a.ref} could not be loaded: {err.message}",
                                     field="adapter", retriable=err.retriable)
                    result, usage = failed_before_engine(
                        (item.job.request_id, item.job.tenant_id, item.job.batch_id), info, item.received_at,
                        self.worker_id, route_reason=reason, routing_us=item.route.decision_us)
                    out.outcomes.append(Outcome(item.tp, item.offset, result=result, usage=usage))
                continue
            runnable.append((item, a.key if a else None, reason))
        if runnable:
            results = self._generate(runnable)
            for (item, key, reason), res in zip(runnable, results):
                a = item.route.adapter if key is not None else None
                served = Served(item.job, a.ref if a else None, a.sha256 if a else None, reason,
                                item.route.decision_us, item.received_at)
                result, usage = succeeded_or_failed(served, res, self.worker_id)
                out.outcomes.append(Outcome(item.tp, item.offset, result=result, usage=usage))
        return out

    def _generate(self, runnable: list[tuple[Routed, str | None, str]]) -> list[GenerationResult]:
        requests = [to_request(item.job, key, item.received_mono_us) for item, key, _ in runnable]
        try:
            return self.engine.generate(requests)
        except Exception:
            if len(requests) == 1:
                log.exception("engine failed on request %s", requests[0].request_id)
                return [GenerationResult(request_id=requests[0].request_id, adapter=requests[0].adapter,
                                         error=EngineError("the engine failed on this request; it was logged",
                                                           code="engine_error", retriable=True))]
            log.exception("engine failed on a batch of %d; running its requests one by one", len(requests))
            return [self._generate([r])[0] for r in runnable]

    # ---------------------------------------------------------------- deliver and commit

    async def _deliver_loop(self) -> None:
        while True:
            await self._outbox_event.wait()
            self._outbox_event.clear()
            if not self.outbox:
                continue
            batch = self.outbox[:]  # stays in the outbox until delivered, so a drain waits for it
            delay = 0.1
            while True:
                try:
                    await self._deliver(batch)
                    del self.outbox[: len(batch)]
                    break
                except (KafkaError, OSError) as e:
                    log.warning("delivery of %d outcomes failed (%s); retrying in %.1fs", len(batch), e, delay)
                except Exception as e:  # the ledger: keep the outcomes, retry; offsets stay uncommitted
                    log.exception("ledger write of %d outcomes failed (%s); retrying in %.1fs", len(batch), e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _deliver(self, batch: list[Outcome]) -> None:
        k = self.s.kafka
        sends = []
        for o in batch:
            if o.result is not None:
                sends.append(await self.producer.send(
                    k.results_topic, o.result.model_dump_json().encode(), key=o.result.request_id.encode()))
            if o.dlq is not None:
                sends.append(await self.producer.send(k.dlq_topic, o.dlq.model_dump_json().encode()))
        await asyncio.gather(*sends)
        rows = [o.usage for o in batch if o.usage is not None]
        if rows:
            try:
                await asyncio.to_thread(self.ledger.record_usage, rows)
            except LedgerError as e:
                if e.retriable:
                    raise
                await self._record_one_by_one([o for o in batch if o.usage is not None])
        for o in batch:
            self.offsets.finished(o.tp, o.offset)
            if o.result is not None:
                r = o.result
                tenant = r.tenant_id if r.tenant_id in self._snapshot.tenants else "unknown"
                adapter = r.adapter or ("base" if r.route.endswith("base_fallback") else "none")
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
                await self.producer.send_and_wait(self.s.kafka.dlq_topic, record.model_dump_json().encode())

    async def _commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.worker.commit_interval_ms / 1000)
            await self._commit()

    async def _commit(self, only: set | None = None) -> None:
        offsets = self.offsets.committable()
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        try:
            await self.consumer.commit(offsets)
        except KafkaError as e:
            log.warning("commit of %s failed: %s; the next commit retries", offsets, e)
            return
        self.offsets.mark_committed(offsets)

    async def on_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._commit(only=set(revoked))
        dropped = self.buckets.drop(set(revoked))
        self.offsets.forget(revoked)
        if dropped:
            log.info("rebalance: %d queued jobs of revoked partitions left to their next owner", len(dropped))


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        await self.worker.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))


def _estimate_tokens(job: Job) -> int:
    """Tokens a job can occupy, for cutting batches (the engine counts exactly)."""
    if job.input_ids is not None:
        prompt = len(job.input_ids)
    elif job.prompt is not None:
        prompt = len(job.prompt) // 3 + 1
    else:
        prompt = sum(len(m.content) for m in job.messages) // 3 + 8 * len(job.messages)
    return prompt + job.max_new_tokens
