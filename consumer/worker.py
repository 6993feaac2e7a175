"""The worker: Kafka jobs in, engine batches, results and ledger rows out, offsets committed last.

Four tasks share one event loop:
- fetch: `getmany`, parse, route the whole fetched batch (one cache round trip), and queue each job in
  the fair scheduler (or answer it at once when it cannot run: a DLQ record or a failed result);
- dispatch: as engine slots free up, take the next jobs from the scheduler in fair order and submit
  them to the engine, which steps in its own thread (continuous batching), so the loop (and
  aiokafka's heartbeats) never waits on the GPU;
- deliver: publish results and DLQ records, write ledger rows, then mark the offsets done;
- commit: commit, per partition, the highest contiguous done offset + 1.
A crash anywhere before the commit means redelivery; the ledger's (tenant, request_id) key keeps a
redelivered job from being billed twice.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import OrderedDict
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from consumer.breaker import BreakerBoard
from consumer.config import Settings
from consumer.delivery import Deliverer, Outcome
from consumer.feeder import EngineFeeder, Routed
from consumer.kafka import make_consumer, make_producer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.outcomes import failed_before_engine
from consumer.registry import Registry, RegistrySnapshot
from consumer.route_cache import LruRouteCache, RedisRouteCache, RouteCache
from consumer.routing import RouteError, Router
from consumer.rules import RuleClassifier
from consumer.scheduler import Pending, Scheduler, TenantPolicy
from consumer.schemas import ErrorInfo, Job, Rejection, Result, dlq_record, parse_job
from consumer.answers import Copy, Key, key_of, stored_result
from consumer.spool import Spool
from engine.async_engine import AsyncEngine

log = logging.getLogger("lorabatch.worker")

SLO_TIERS = ("premium", "standard", "batch")  # the engine's adapter eviction weights know these tiers
_CACHED_ANSWER_CHARS = 16_384  # answers kept in memory stay small: 10,000 of them are under ~200 MB


def make_route_cache(s: Settings) -> RouteCache:
    r = s.routing
    if r.cache == "redis":
        return RedisRouteCache(r.redis_url, r.cache_entries, r.cache_ttl_s, prefix=r.redis_prefix,
                               timeout_s=r.redis_timeout_ms / 1000, backoff_s=r.redis_backoff_s)
    return LruRouteCache(r.cache_entries, r.cache_ttl_s)


class Worker:
    def __init__(self, settings: Settings, engine, registry: Registry, ledger, *, metrics: WorkerMetrics | None = None,
                 route_cache: RouteCache | None = None):
        self.s = settings
        self.engine = engine
        self.registry = registry
        self.ledger = ledger
        self.metrics = metrics or WorkerMetrics()
        self.worker_id = settings.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        w, r = settings.worker, settings.routing
        self.capacity = settings.engine.max_batch_size  # requests the engine runs at once
        self.scheduler = Scheduler(w.max_batch_size, w.max_batch_tokens, w.max_adapters_per_batch,
                                   affinity_slack=w.affinity_slack_tokens, max_defer_ms=w.max_defer_ms,
                                   capacity=self.capacity, headroom=w.headroom_slots)
        self.breakers = BreakerBoard(r.breaker_failure_rate, r.breaker_min_requests, r.breaker_window_s, r.breaker_cooldown_s)
        self.router = Router(route_cache or make_route_cache(settings), self.breakers)
        self.offsets = OffsetTracker()
        self.aengine = AsyncEngine(engine)
        self.feeder = EngineFeeder(self.aengine, registry.store, self.worker_id, settings.ledger.gpu_kind)
        # A stable default path: a restarted worker (a new pid) finds what its predecessor spooled.
        self.spool = Spool(w.spool_path or Path(".lorabatch/spool") / f"{w.worker_id or 'worker'}.sqlite", w.spool_max_records)
        self._work_event = asyncio.Event()
        self._stopping = asyncio.Event()
        self._snapshot_at = 0.0
        self._apply_snapshot(registry.snapshot())
        self._in_engine: dict[int, tuple[Pending, Routed]] = {}
        self._running: dict[Key, list[Copy]] = {}  # keys queued or in the engine here, with their waiting copies
        self._answers: OrderedDict[Key, Result] = OrderedDict()  # recent answers, newest last (bounded)
        self._seen: OrderedDict[tuple, None] = OrderedDict()  # recent messages read, by position and timestamp
        self._paused = False
        self._cache_errors_seen = 0
        self._logs_checked_at = 0.0
        self._revoked: set[TopicPartition] = set()  # of the latest rebalance
        self._lookup_warned_at = 0.0
        self.consumer = None
        self.deliverer: Deliverer | None = None

    # ---------------------------------------------------------------- lifecycle

    def stop(self) -> None:
        """Ask the worker to drain and exit (SIGTERM handler)."""
        self._stopping.set()
        self._work_event.set()

    async def run(self) -> None:
        k = self.s.kafka
        producer = make_producer(k, client_id=self.worker_id)
        static = {"group_instance_id": self.worker_id} if self.s.worker.static_membership and self.s.worker.worker_id else {}
        self.consumer = make_consumer(k, group_id=k.group_id, client_id=self.worker_id, max_poll_records=500, **static)
        self.consumer.subscribe([k.jobs_topic], listener=_Rebalance(self))
        self.deliverer = Deliverer(k, producer, self.ledger, self.offsets, self.metrics, self.worker_id,
                                   lambda t: t in self._snapshot.tenants, self.spool,
                                   flush_s=self.s.worker.ledger_flush_ms / 1000)
        await producer.start()
        self.aengine.start()
        try:
            await self.consumer.start()
            try:
                await self._run_tasks()
            finally:
                await self._commit()
                await self.consumer.stop()
        finally:
            await self.aengine.close(drain=False)
            await producer.stop()
            self.spool.close()
            close = getattr(self.router.cache, "close", None)
            if close is not None:
                await close()

    async def _run_tasks(self) -> None:
        assert self.deliverer is not None
        fetch = asyncio.create_task(self._fetch_loop(), name="fetch")
        dispatch = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        deliver = asyncio.create_task(self.deliverer.run(), name="deliver")
        commit = asyncio.create_task(self._commit_loop(), name="commit")
        gpu_time = asyncio.create_task(self._gpu_time_loop(), name="gpu-time")
        flush = asyncio.create_task(self.deliverer.flush_spool(), name="spool-flush")
        tasks = [fetch, dispatch, deliver, commit, gpu_time, flush]
        try:
            # The fetch loop ends on stop; the dispatcher then drains the queue, the deliverer the outbox.
            # The others never end on their own: if one does, it failed, and so does the worker.
            running = {fetch, dispatch}
            while running:
                done, _ = await asyncio.wait(running | {deliver, gpu_time, flush}, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    t.result()
                    if t in (deliver, gpu_time, flush):
                        raise RuntimeError(f"the {t.get_name()} task stopped")
                running -= done
            await self._record_gpu_time()
            await asyncio.wait_for(self.deliverer.drain(), timeout=60)
            await self.deliverer.flush_once()  # what the ledger takes now; the rest stays spooled for the next start
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # ---------------------------------------------------------------- fetch, route, queue

    async def _fetch_loop(self) -> None:
        delay = 0.1
        while not self._stopping.is_set():
            self._backpressure()
            try:
                batches = await self.consumer.getmany(timeout_ms=100, max_records=500)
            except KafkaError as e:  # the broker went away or the log moved under us: look again, never die
                self.metrics.fetch_errors.inc()
                log.warning("fetch failed (%s); checking the partitions' logs and retrying in %.1fs", e, delay)
                await self._check_logs()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            if batches:
                await self._ingest([(tp, m) for tp, messages in batches.items() for m in messages])
            if time.monotonic() - self._logs_checked_at >= self.s.worker.log_check_s:
                await self._check_logs()
            self._refresh_registry()
            self._gauges()

    def _backpressure(self) -> None:
        w = self.s.worker
        d = self.deliverer
        over = (len(self.scheduler) + len(self._in_engine) >= w.max_queued_jobs
                or self.scheduler.queued_tokens >= w.max_queued_tokens
                or d is not None and (self.spool.full or d.schema_behind))
        assigned = self.consumer.assignment()
        if over and not self._paused and assigned:
            self.consumer.pause(*assigned)
            self._paused = True
            why = ("the ledger's schema is missing or behind" if d is not None and d.schema_behind else
                   f"the spool holds {len(self.spool)} records" if self.spool.full else
                   f"{len(self.scheduler)} jobs, {self.scheduler.queued_tokens} tokens queued")
            log.warning("fetching paused: %s", why)
        elif not over and self._paused:
            self.consumer.resume(*self.consumer.paused())
            self._paused = False
            log.info("fetching resumed")

    async def _check_logs(self) -> None:
        """Reset the marks of a partition whose log now ends below them (truncated, recreated, a memory-only
        broker restarted): the partition starts a new epoch and is read again from the beginning, as
        `auto_offset_reset = earliest` does. The log end is the high watermark of the latest fetch response
        (the embedded broker's ListOffsets answers the last batch's base offset + 1, not the log end)."""
        self._logs_checked_at = time.monotonic()
        for tp in list(self.consumer.assignment()):
            mark, end = self.offsets.mark(tp), self.consumer.highwater(tp)
            if end is None or mark is None or end >= mark:
                continue
            self.offsets.reset(tp)
            self.metrics.log_resets.inc()
            await self.consumer.seek_to_beginning(tp)
            log.warning("the log of %s:%s ends at %s, below the %s this worker fetched: it was reset (a broker restart, "
                        "a recreated topic); its marks are dropped and it is read again from the beginning",
                        tp.topic, tp.partition, end, mark)

    def _apply_snapshot(self, snapshot: RegistrySnapshot) -> None:
        self._snapshot = snapshot
        self._classifier = RuleClassifier(snapshot.rules)
        for t in snapshot.tenants.values():
            self.scheduler.set_policy(t.id, TenantPolicy(t.weight, t.requests_per_minute, t.tokens_per_minute))
        self._snapshot_at = time.monotonic()

    def _refresh_registry(self) -> None:
        if time.monotonic() - self._snapshot_at >= self.s.worker.registry_refresh_s:
            try:
                self._apply_snapshot(self.registry.snapshot())
            except Exception:  # the database is away: keep routing on the last snapshot
                self._snapshot_at = time.monotonic()
                log.exception("registry refresh failed; routing on the previous snapshot")

    def _parse(self, m) -> Job | Rejection:
        if m.value is not None and len(m.value) > self.s.kafka.max_message_bytes:
            return Rejection(ErrorInfo(
                code="message_too_large", message=f"{len(m.value)} bytes exceeds kafka.max_message_bytes="
                f"{self.s.kafka.max_message_bytes}; send a shorter prompt"), False)
        try:
            return parse_job(m.value)
        except Exception as e:  # noqa: BLE001 - whatever a message does to the parser, it is that message's fault
            log.exception("parsing %s:%s@%s failed", m.topic, m.partition, m.offset)
            return Rejection(ErrorInfo(code="unprocessable", message=f"the message could not be read as a job "
                                       f"({type(e).__name__}); send one JSON job object"), False)

    async def _ingest(self, messages: list) -> None:
        now = datetime.now(UTC)
        items: list[tuple[TopicPartition, object, int, Job | Rejection]] = []
        for tp, m in messages:
            epoch = self.offsets.fetched(tp, m.offset)
            items.append((tp, m, epoch, self._parse(m)))
        fresh = {k for *_, p in items if (k := key_of(p)) is not None and k not in self._running and k not in self._answers}
        stored = await self._stored(fresh)
        jobs: list[tuple[TopicPartition, int, int, Job]] = []
        for tp, m, epoch, parsed in items:
            try:
                # The same message read again (the group rejoined after a broker restart, say) was answered
                # already: its offset counts as done without a second result or DLQ record.
                again = self._seen_message((tp.topic, tp.partition, m.offset, m.timestamp))
                key = key_of(parsed)
                if key is None:
                    if again:
                        self.deliverer.emit(Outcome(tp, m.offset, epoch=epoch))
                    else:
                        self._dead_letter(tp, m, epoch, parsed)
                elif key in self._running:
                    self._running[key].append(Copy(tp, m.offset, epoch, parsed, silent=again))
                elif (answer := self._answers.get(key)) is not None or (answer := stored.get(key)) is not None:
                    self.metrics.replays.labels("redelivered" if again else "memory" if key in self._answers else "ledger").inc()
                    self.deliverer.emit(Outcome(tp, m.offset, result=None if again else answer, epoch=epoch))
                elif isinstance(parsed, Rejection):
                    self._reject(tp, m.offset, epoch, parsed, now)
                else:
                    self._running[key] = []
                    jobs.append((tp, m.offset, epoch, parsed))
            except Exception as e:  # noqa: BLE001 - a bug on our side: this message alone goes to the DLQ
                log.exception("ingesting %s:%s@%s failed", tp.topic, tp.partition, m.offset)
                self._dead_letter(tp, m, epoch, Rejection(ErrorInfo(
                    code="unprocessable", message=f"the worker failed on this message ({type(e).__name__}); it was logged"), False))
        await self._admit(jobs, now)

    async def _admit(self, jobs: list[tuple[TopicPartition, int, int, Job]], now: datetime) -> None:
        """Route jobs (one cache round trip) and queue them in the fair scheduler."""
        if not jobs:
            return
        try:
            routes = await self.router.route_batch(self._snapshot, self._classifier, [j for *_, j in jobs])
        except Exception as e:  # noqa: BLE001 - routing must not lose the batch: each job fails on its own
            log.exception("routing %d jobs failed", len(jobs))
            routes = [RouteError(ErrorInfo(code="routing_failed", retriable=True,
                                           message=f"routing failed ({type(e).__name__}); it was logged")) for _ in jobs]
        mono_us = time.monotonic_ns() // 1000
        for (tp, offset, epoch, job), route in zip(jobs, routes):
            if isinstance(route, RouteError):
                self._fail(tp, offset, epoch, job, route.info, now, route.info.code)
                continue
            self.metrics.route_decisions.labels(route.reason).inc()
            self.metrics.route_decision.observe(route.decision_us / 1e6)
            tokens = _estimate_tokens(job)
            if job.on_quota == "fail" and self.scheduler.over_quota(job.tenant_id, tokens):
                t = self._snapshot.tenants[job.tenant_id]
                # Not an answer to keep: nothing ran, so the same request_id may be sent again later.
                self._fail(tp, offset, epoch, job, ErrorInfo(
                    code="quota_exceeded", retriable=True, message=f"tenant {job.tenant_id!r} is over its rate limit "
                    f"({t.requests_per_minute or 'unlimited'} requests, {t.tokens_per_minute or 'unlimited'} tokens per "
                    f"minute); retry later, or send on_quota=\"wait\" to queue instead"), now, route.label, keep=False)
                continue
            item = Routed(job, route, tp, offset, now, mono_us, epoch=epoch)
            self.scheduler.push(Pending(job.tenant_id, route.adapter.key if route.adapter else None, tokens,
                                        time.monotonic(), item, partition=tp, priority=job.priority))
        self._work_event.set()

    async def _stored(self, keys: set[Key]) -> dict[Key, Result]:
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
                for key, row in (await asyncio.to_thread(self.ledger.answered, rest)).items():
                    found[key] = stored_result(key, row.result_json, row)
        except Exception as e:  # noqa: BLE001 - down, behind its schema: going by what this worker knows
            # Answers written by this worker are in memory or the spool; another worker's, written while the
            # ledger is away, cannot be seen: such a copy runs again and is billed once (the ledger's key).
            if time.monotonic() - self._lookup_warned_at > 30:
                self._lookup_warned_at = time.monotonic()
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

    def _answer(self, key: Key, outcome: Outcome, *, keep: bool = True) -> None:
        """Emit the answer to a key's first message, then the same answer to every copy that waited for it."""
        self.deliverer.emit(outcome)
        result = outcome.result
        assert result is not None, outcome
        if keep and self.s.worker.answered_cache and len(result.text) + len(result.output_ids) * 8 < _CACHED_ANSWER_CHARS \
                and result.logprobs is None:  # big answers are read back from the spool or the ledger instead
            self._answers[key] = result
            self._answers.move_to_end(key)
            while len(self._answers) > self.s.worker.answered_cache:
                self._answers.popitem(last=False)
        for c in self._running.pop(key, []):
            self.metrics.replays.labels("redelivered" if c.silent else "waited").inc()
            self.deliverer.emit(Outcome(c.tp, c.offset, result=None if c.silent else result, epoch=c.epoch))

    def _fail(self, tp: TopicPartition, offset: int, epoch: int, job: Job, error: ErrorInfo, now: datetime, reason: str,
              keep: bool = True) -> None:
        if error.code not in ("quota_exceeded",):
            self.metrics.route_decisions.labels(error.code).inc()
        result, usage = failed_before_engine((job.request_id, job.tenant_id, job.batch_id), error, now, self.worker_id,
                                             route_reason=reason, bill=keep and job.tenant_id in self._snapshot.tenants)
        self._answer((job.tenant_id, job.request_id), Outcome(tp, offset, result=result, usage=usage, epoch=epoch), keep=keep)

    def _reject(self, tp: TopicPartition, offset: int, epoch: int, rej: Rejection, now: datetime) -> None:
        result, usage = failed_before_engine((rej.request_id, rej.tenant_id, rej.batch_id), rej.error, now,
                                             self.worker_id, bill=rej.tenant_id in self._snapshot.tenants)
        self._answer((rej.tenant_id, rej.request_id), Outcome(tp, offset, result=result, usage=usage, epoch=epoch))

    def _dead_letter(self, tp: TopicPartition, m, epoch: int, rej: Rejection) -> None:
        record = dlq_record(m.value, rej.error, topic=tp.topic, partition=tp.partition, offset=m.offset,
                            timestamp_ms=m.timestamp, worker_id=self.worker_id, max_bytes=self.s.kafka.max_message_bytes,
                            request_id=rej.request_id, tenant_id=rej.tenant_id, batch_id=rej.batch_id)
        self.metrics.dlq.labels(rej.error.code).inc()
        log.warning("dlq %s:%s@%s %s", tp.topic, tp.partition, m.offset, rej.error.message[:300])
        self.deliverer.emit(Outcome(tp, m.offset, dlq=record, epoch=epoch))

    # ---------------------------------------------------------------- dispatch

    async def _dispatch_loop(self) -> None:
        """Keep the engine's slots filled in fair order; return once stopping and everything has run."""
        while True:
            free = self.capacity - len(self._in_engine)
            wait = self.scheduler.next_eligible_in()
            if wait is None and self._stopping.is_set():
                if not self._in_engine:
                    return
            batch = self.scheduler.pop_batch(resident=self._resident(), max_requests=free) if free > 0 and wait is not None else []
            if not batch:
                self._work_event.clear()
                timeout = max(wait, 0.005) if wait is not None and free > 0 else None
                try:
                    await asyncio.wait_for(self._work_event.wait(), timeout=timeout)
                except TimeoutError:
                    pass
                continue
            self.metrics.batches.inc()
            self.metrics.batch_size.observe(len(batch))
            for p in batch:
                self._in_engine[id(p)] = (p, p.payload)
                asyncio.create_task(self._serve(p), name=f"serve-{p.payload.job.tenant_id}/{p.payload.job.request_id}")

    async def _serve(self, p: Pending) -> None:
        item: Routed = p.payload
        key = (item.job.tenant_id, item.job.request_id)
        tier = self._snapshot.tenants.get(item.job.tenant_id)
        slo_tier = tier.tier if tier is not None and tier.tier in SLO_TIERS else "standard"
        try:
            served = await self.feeder.serve(item, slo_tier)
        except Exception:  # a bug on our side: fail this job alone, keep the worker
            log.exception("serving %s/%s failed", *key)
            result, usage = failed_before_engine(
                (item.job.request_id, item.job.tenant_id, item.job.batch_id),
                ErrorInfo(code="engine_error", message="the worker failed on this job; it was logged", retriable=True),
                item.received_at, self.worker_id, route_reason=item.route.label, routing_us=item.route.decision_us)
            if not item.abandoned:
                self._answer(key, Outcome(item.tp, item.offset, result=result, usage=usage, epoch=item.epoch))
        else:
            if served.adapter_key is not None:
                self.breakers.record(served.adapter_key, served.adapter_ok)
            if served.outcome is not None:
                self._answer(key, served.outcome)
        finally:
            self._in_engine.pop(id(p), None)
            self.scheduler.finished(p)
            if item.abandoned:
                await self._orphaned(key, self._revoked)
            self._work_event.set()

    async def _orphaned(self, key: Key, revoked: set[TopicPartition]) -> None:
        """The first copy of a key was abandoned (its partition revoked): a copy from a partition still ours
        runs in its place; copies from revoked partitions are left to their new owner."""
        copies = [c for c in self._running.pop(key, []) if c.tp not in revoked]
        if not copies:
            return
        first, *rest = copies
        if isinstance(first.parsed, Rejection):
            self._reject(first.tp, first.offset, first.epoch, first.parsed, datetime.now(UTC))
            for c in rest:
                self.deliverer.emit(Outcome(c.tp, c.offset, result=self._answers.get(key), epoch=c.epoch))
            return
        self._running[key] = rest
        await self._admit([(first.tp, first.offset, first.epoch, first.parsed)], datetime.now(UTC))

    async def _gpu_time_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.worker.ledger_flush_ms / 1000)
            if not self.aengine.alive:  # its step loop died: fail loudly rather than hang on its results
                raise RuntimeError("the engine thread stopped; see the log above; its jobs will be redelivered")
            await self._record_gpu_time()
            stats = await self.aengine.stats()
            m = self.metrics
            m.memory_used.set(stats.get("lora_memory_used_bytes", 0))
            m.kv_used_blocks.set(stats.get("kv_pool_used_blocks", 0))
            m.kv_hit_rate.set(stats.get("kv_pool_hit_rate", 0.0))
            m.warm_pool_hit_rate.set(stats.get("warm_pool_hit_rate", 0.0))

    async def _record_gpu_time(self) -> None:
        """Adapter loads and busy time: the ledger's inputs for cold starts and period conservation. Written
        to the ledger, or to the spool while it is away: never dropped."""
        loads, busy = await self.feeder.drain_gpu_time()
        for load in loads:
            self.metrics.cold_start.labels(load.tier).observe(load.load_us / 1000)
        await self.deliverer.write(loads)
        if busy is not None:
            await self.deliverer.write([busy])

    def _resident(self) -> set[str | None]:
        # The engine thread's snapshot: asking the engine itself from the event loop would race its step.
        return set(self.aengine.resident) | {None}

    # ---------------------------------------------------------------- commit, rebalance, metrics

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
        """Let what runs for the revoked partitions finish within the deadline and commit it; abandon the
        rest (aborted in the engine, its results unpublished, its offsets uncommitted: the new owner redoes
        it) and leave the queued jobs to the new owner."""
        deadline = time.monotonic() + self.s.worker.revoke_deadline_s
        self._revoked = set(revoked)

        def revoked_running() -> list[Routed]:
            return [r for _, r in self._in_engine.values() if r.tp in revoked]

        while revoked_running() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for item in revoked_running():
            item.abandoned = True
            await self.aengine.abort(item.job.request_id, tenant=item.job.tenant_id)
        if self.deliverer is not None:
            try:
                await asyncio.wait_for(self.deliverer.drain(), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("rebalance: revoked work not delivered within the deadline; it will be redelivered")
        await self._commit(only=set(revoked))
        dropped = self.scheduler.drop(set(revoked))
        for p in dropped:  # queued, never run: the new owner answers them, and the copies that waited here
            item = p.payload
            key = (item.job.tenant_id, item.job.request_id)
            item.abandoned = True
            await self._orphaned(key, revoked)
        self.offsets.forget(revoked)
        if dropped:
            log.info("rebalance: %d queued jobs of revoked partitions left to their next owner", len(dropped))

    def _gauges(self) -> None:
        m = self.metrics
        depth = self.scheduler.depth_by_tenant()
        for tenant in self._snapshot.tenants:  # registered tenants only: a bounded label set
            m.queue_depth.labels(tenant).set(depth.get(tenant, 0))
        m.in_flight.set(self.offsets.in_flight())
        m.circuit_open.set(len(self.breakers.open_circuits()))
        errors = getattr(self.router.cache, "errors", 0)
        if errors > self._cache_errors_seen:
            m.route_cache_errors.inc(errors - self._cache_errors_seen)
            self._cache_errors_seen = errors
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            nxt = self.offsets.next_fetch(tp)
            if high is not None and nxt is not None:
                m.consumer_lag.labels(str(tp.partition)).set(max(0, high - nxt))


class _Rebalance(ConsumerRebalanceListener):
    def __init__(self, worker: Worker):
        self.worker = worker

    async def on_partitions_revoked(self, revoked):
        await self.worker.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))


def _estimate_tokens(job: Job) -> int:
    """Tokens a job can occupy, for cutting batches and fair shares (the engine counts exactly)."""
    if job.input_ids is not None:
        prompt = len(job.input_ids)
    elif job.prompt is not None:
        prompt = len(job.prompt) // 3 + 1
    else:
        prompt = sum(len(m.content) for m in job.messages) // 3 + 8 * len(job.messages)
    return prompt + job.max_new_tokens



