"""The worker: Kafka jobs in, engine batches, results and ledger rows out, offsets committed last.

Four tasks share one event loop:
- fetch: `getmany`, parse, route the whole fetched batch (one cache round trip), and queue each job in
  the fair scheduler (or answer it at once when it cannot run: a DLQ record or a failed result);
- dispatch: as engine places free up, take the next jobs from the scheduler in fair order and submit
  them to the engine, which steps in a process of its own (`worker.engine_process`, the default) or a
  thread (continuous batching), so the loop (and aiokafka's heartbeats) never waits on the GPU. The places are the engine's batch and
  `worker.engine_queue_jobs` more, which wait in the engine: a place the engine frees is taken at its
  next step, not after the finished job's result has come to this loop and a new job gone back;
- deliver: publish results and DLQ records, write ledger rows, then mark the offsets done;
- commit: commit, per partition, the highest contiguous done offset + 1.
A crash anywhere before the commit means redelivery; the ledger's (tenant, request_id) key keeps a
redelivered job from being billed twice.

What a fetched message becomes (answered, parked, dead-lettered or queued) is consumer/intake.py; pausing,
log resets and lag of the assigned partitions are consumer/partitions.py; commits, the jobs of revoked partitions and
leaving the group are consumer/handover.py.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sqlite3
import sys
import time
from datetime import UTC, datetime

from aiokafka.errors import KafkaError

from consumer.breaker import BreakerBoard
from consumer.config import ConfigError, Settings, check_worker_fits
from consumer.delivery import STALL_S, Deliverer, Outcome, SpoolUnavailable
from consumer.feeder import EngineFeeder, Routed
from consumer.handover import COMMIT_TIMEOUT_S, Handover, Rebalance
from consumer.intake import Intake, stepped_over
from consumer.ledger_calls import LedgerCalls
from consumer.kafka import close_producer, group_members, make_consumer, make_producer
from consumer.logs import Outage, Throttle
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.outcomes import failed_before_engine, quota_tokens, serving_error
from consumer.partitions import Partitions
from consumer.registry import Registry, RegistrySnapshot
from consumer.route_cache import LruRouteCache, RedisRouteCache, RouteCache
from consumer.routing import Router
from consumer.scheduler import Pending, Scheduler, TenantPolicy
from consumer.schemas import ErrorInfo
from consumer.services import shown_url
from consumer.spool import Spool, open_fix
from consumer.stages import EngineClock, StageLog
from consumer.undecodable import undecodable
from consumer.waits import Stopped, connect, wait_for_redis
from consumer.worker_lease import WorkerIdLease, lease_for
from engine.api import ADAPTER_ERROR_CODES, EngineError
from engine.async_engine import AsyncEngine
from engine.engine import Engine
from engine.engine_process import EngineProcess

log = logging.getLogger("lorabatch.worker")

SLO_TIERS = ("premium", "standard", "batch")  # the engine's adapter eviction weights know these tiers
# An engine that has not stopped this long after the worker's last commit (a hung GPU, a step that never ends) is killed
# (a process) or left behind (a daemon thread): its jobs are uncommitted already, and the exit must fit a grace period.
ENGINE_CLOSE_TIMEOUT_S = 10.0
GAUGES_S = 0.25  # how often the gauges are refreshed (a Prometheus scrape comes every 15 s or so)


def make_route_cache(s: Settings, poisoned=None) -> RouteCache:
    """`poisoned`: the counter of Redis entries that held no adapter reference (RedisRouteCache)."""
    r = s.routing
    if r.cache == "redis":
        return RedisRouteCache(r.redis_url, r.cache_entries, r.cache_ttl_s, prefix=r.redis_prefix,
                               timeout_s=r.redis_timeout_ms / 1000, backoff_s=r.redis_backoff_s, poisoned=poisoned)
    return LruRouteCache(r.cache_entries, r.cache_ttl_s)


async def end_tasks(tasks: list[asyncio.Task], *, wait_s: float = 1.0, rounds: int = 10) -> None:
    """Cancel `tasks` and wait for them to end; one still running `wait_s` later is cancelled again, up to `rounds`
    times, then left running, logged. Before Python 3.12, `asyncio.wait_for` hands its caller the inner result when the
    inner future completes as the caller is cancelled, and a loop around it goes on as if never cancelled: under load a
    worker's stop once waited for ever on its gpu-time loop (cancelled in the engine stats' `wait_for`)."""
    pending = {t for t in tasks if not t.done()}
    for _ in range(rounds):
        if not pending:
            break
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait_s)
    if pending:
        log.error("stopping: %s did not end when cancelled %d times; left running",
                  ", ".join(sorted(t.get_name() for t in pending)), rounds)  # fmt: skip
    for t in tasks:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved (an error of one was raised or logged where it happened)


class Worker:
    def __init__(self, settings: Settings, engine: Engine | EngineProcess, registry: Registry, ledger, *,
                 metrics: WorkerMetrics | None = None, route_cache: RouteCache | None = None, keep_stages: int = 0,
                 lease: WorkerIdLease | None = None):
        """`engine`: an Engine, which the worker steps on a thread of its own (AsyncEngine), or a started EngineProcess.
        `keep_stages`: keep the stage stamps of the last this many committed jobs in `stages.kept` (the bench)."""
        self.s = settings
        if isinstance(engine, EngineProcess):
            assert engine.started, "start() the engine process first: the worker sizes itself on its derived config"
            self.aengine = engine
        else:
            self.aengine = AsyncEngine(engine)
        engine_config = self.aengine.config
        self.registry = registry
        self.ledger = ledger
        self.metrics = metrics or WorkerMetrics()
        self.metrics.health.engine_alive = lambda: self.aengine.alive
        self.metrics.health.store_root = getattr(registry.store, "root", None)  # /readyz: the store's folder, if it has one
        self.worker_id = settings.worker.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        w, r = settings.worker, settings.routing
        try:
            check_worker_fits(w, engine_config)  # the engine's sizes as derived for its device (engine.sizing)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        # Jobs handed to the engine at once: the requests it runs, and those waiting in it for the next free place
        # (unset: another batch, so that requests that finish together, as a batch job's do, are replaced at once).
        queue = engine_config.max_batch_size if w.engine_queue_jobs is None else w.engine_queue_jobs
        self.capacity = engine_config.max_batch_size + queue
        self.scheduler = Scheduler(w.max_batch_size, w.max_batch_tokens, w.max_adapters_per_batch,
                                   affinity_slack=w.affinity_slack_tokens, max_defer_ms=w.max_defer_ms,
                                   capacity=self.capacity, headroom=w.headroom_slots)
        self.breakers = BreakerBoard(r.breaker_failure_rate, r.breaker_min_requests, r.breaker_window_s, r.breaker_cooldown_s)
        self.router = Router(route_cache or make_route_cache(settings, self.metrics.route_cache_poisoned), self.breakers)
        self.metrics.health.route_cache = self.router.cache  # /readyz names Redis while it fails
        self.offsets = OffsetTracker()
        self.stages = StageLog(self.metrics.stage, keep=keep_stages, dropped=self.metrics.stage_dropped)  # consumer.stages
        self.engine_clock = EngineClock()
        self.feeder = EngineFeeder(self.aengine, registry.store, self.worker_id, settings.ledger.gpu_kind)
        # A stable default path: a restarted worker (a new pid) finds what its predecessor spooled.
        # Stamped with its ledger, so a worker beside it flushes what it leaves only into that ledger (Deliverer.flush_others).
        spool_path = w.spool_file()
        try:
            self.spool = Spool(spool_path, w.spool_max_records, ledger=shown_url(settings.ledger.url))
        except (OSError, sqlite3.Error) as e:
            # A folder that is a file, a path not writable: named by the key that sets it (the OSError alone said
            # "File exists: ...; check the path", and sqlite's "unable to open database file" named nothing).
            key = "worker.spool_path" if w.spool_path else "worker.spool_path (unset: .lorabatch/spool/<worker.worker_id>.sqlite)"
            why = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename else str(e)
            raise ConfigError(f"the spool file {spool_path} cannot be opened ({why}); {open_fix(e, spool_path, key)}") from e
        # An id set by hand is held while the worker runs, so that a second worker under it refuses to start: on this
        # host beside the spool, across hosts in Redis where routing uses it (consumer.worker_lease). `lease`: one the
        # caller took already (the command, before building the engine); the worker releases it as it exits.
        self.lease = lease or lease_for(settings, conflicts=self.metrics.worker_id_conflicts)
        self._work_event = asyncio.Event()
        self._stopping = asyncio.Event()
        self._registry_outage = Outage("registry refresh", log, "routing on the previous snapshot")
        self._refreshing: asyncio.Task | None = None  # the registry refresh under way (`_start_registry_refresh`)
        # Every call into the ledger database from the event loop: off it, bounded in time (consumer.ledger_calls).
        self.ledger_calls = LedgerCalls()
        snapshot = registry.snapshot()
        self.intake = Intake(settings, self.metrics, self.worker_id, self.scheduler, self.router, self.spool, ledger,
                             self._work_event, snapshot, ledger_calls=self.ledger_calls)
        self._apply_snapshot(snapshot)
        self._in_engine: dict[int, tuple[Pending, Routed]] = {}
        self._cache_errors_seen = self._cache_errors_said = 0  # _said: the count at the last log line about them
        self._cache_errors_throttle = Throttle(60.0)
        self.consumer = None
        # commits, revoked partitions' jobs, leaving the group (consumer.handover)
        self.handover = Handover(self, self._in_engine)
        self.partitions: Partitions | None = None
        self.deliverer: Deliverer | None = None
        self._in_flight_at_stop: int | None = None
        self._left_on_revoke_at_stop = 0  # offsets.left_on_revoke at the stop request
        self._stop_at = 0.0  # monotonic time of the stop request

    # ---------------------------------------------------------------- lifecycle

    @property
    def stopping(self) -> bool:
        """Whether the worker was asked to stop."""
        return self._stopping.is_set()

    def stop(self) -> None:
        """Ask the worker to drain and exit (SIGTERM handler): what is queued keeps running for worker.stop_deadline_s,
        then is left to the partitions' next owners (consumer.handover `leave_queue_on_stop`)."""
        if not self._stopping.is_set():
            self._in_flight_at_stop = self.offsets.in_flight()
            self._left_on_revoke_at_stop = self.offsets.left_on_revoke
            self._stop_at = time.monotonic()
        self.metrics.health.phase = "stopping"
        if self.deliverer is not None:
            self.deliverer.stopping = True  # a spool that cannot be written is given up on, not waited for past the deadline
        self._stopping.set()
        self._work_event.set()

    async def run(self) -> None:
        """Connect (waiting for the broker and Redis as long as it takes), serve until stopped, drain, commit."""
        producer = None
        switch_interval = sys.getswitchinterval()
        if not self._stopping.is_set():
            self.metrics.health.phase = "connecting"
        if self.s.worker.switch_interval_ms is not None:  # the engine thread takes the interpreter lock back sooner
            sys.setswitchinterval(self.s.worker.switch_interval_ms / 1000)
        waiting = self.metrics.waiting  # said on /metrics as well as in the log: a worker waiting at start looked idle there
        try:
            waiting.labels("broker").set(1)
            producer = await connect(lambda: make_producer(self.s.kafka, client_id=self.worker_id), self.s, self._stopping)
            waiting.labels("broker").set(0)
            waiting.labels("redis").set(1)
            await wait_for_redis(self.router.cache, self.s, self._stopping)
            waiting.labels("redis").set(0)
            if self.lease is not None:  # before joining the group: a second member under one id fences the first; taken
                await self.lease.acquire(self._stopping)  # already, checked again now that Redis answers. WorkerIdTaken:
                self.lease.start_refreshing()  # another live worker holds the id
            waiting.labels("broker").set(1)
            self.consumer = await connect(self._make_consumer, self.s, self._stopping,
                                          explain=lambda: group_members(self.s.kafka))
            waiting.labels("broker").set(0)
        except Stopped:
            log.info("stopped while waiting for the broker; nothing was fetched")
        else:
            self.partitions = Partitions(self.consumer, self.offsets, self.metrics)
            self.deliverer = self.intake.deliverer = Deliverer(
                self.s.kafka, producer, self.ledger, self.offsets, self.metrics, self.worker_id,
                lambda t: t in self.intake.snapshot.tenants, self.spool, flush_s=self.s.worker.ledger_flush_ms / 1000,
                stages=self.stages, ledger_calls=self.ledger_calls, gpu_kind=self.s.ledger.gpu_kind)
            self.deliverer.stopping = self._stopping.is_set()  # a stop that came while the broker was waited for
            if not self.aengine.started:
                self.aengine.start()
            health = self.metrics.health
            try:
                try:
                    if not self._stopping.is_set():
                        health.phase = "serving"
                    await self._run_tasks()
                finally:
                    health.phase = "stopping"
                    await self.handover.commit()
                    self.intake.dlq_log.flush(force=True)
                    self._gauges()  # what the drain left: 0 in flight once it finished every job
                    self._log_summary()
                    await self.handover.leave()  # before the engine closes: a last revoke may still abort its work
            finally:
                await self._close_engine()
        finally:
            if self.consumer is not None:
                await self.handover.leave()
            if producer is not None:
                await close_producer(producer)
            if self.lease is not None:  # out of the group: the id is free for a restart; no refresh takes it again after
                await end_tasks([t for t in (self.lease.refreshing,) if t is not None])
                await self.lease.release()
            self.spool.close()
            self.ledger_calls.close()
            close = getattr(self.router.cache, "close", None)
            if close is not None:
                await close()
            sys.setswitchinterval(switch_interval)

    async def _close_engine(self) -> None:
        if isinstance(self.aengine, EngineProcess):
            await self.aengine.close(drain=False, timeout_s=ENGINE_CLOSE_TIMEOUT_S)
            return
        try:
            await asyncio.wait_for(self.aengine.close(drain=False), ENGINE_CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("the engine thread did not stop within %.0f s; exiting without it (its jobs stay uncommitted)",
                      ENGINE_CLOSE_TIMEOUT_S)

    def _make_consumer(self):
        k, w = self.s.kafka, self.s.worker
        static = {"group_instance_id": self.worker_id} if w.static_membership and w.worker_id else {}
        # A rebalance may wait for on_revoked: the revoked work's deadline and a last commit, and then some.
        rebalance_ms = max(k.session_timeout_ms, int((w.revoke_deadline_s + COMMIT_TIMEOUT_S + 5) * 1000))
        consumer = make_consumer(k, group_id=k.group_id, client_id=self.worker_id, max_poll_records=500,
                                 rebalance_timeout_ms=rebalance_ms, **static)  # fmt: skip
        consumer.subscribe([k.jobs_topic], listener=Rebalance(self.handover))
        return consumer

    def _log_summary(self) -> None:
        """One line on the way out: what was in flight at the stop and what became of it, what went out. A rebalance
        during the drain revokes partitions and forgets their offsets: what they still had pending is counted as
        abandoned, and what this worker committed in them is listed, where the line said "0 abandoned" and "offsets
        committed: none" for a worker that had left 32 jobs and committed two partitions."""
        d = self.deliverer
        left = self.offsets.in_flight()
        if self._stopping.is_set():
            left += self.offsets.left_on_revoke - self._left_on_revoke_at_stop
        at_stop = self._in_flight_at_stop if self._in_flight_at_stop is not None else left
        committed = {f"{tp.topic}:{tp.partition}": o for tp, o in self.offsets.committed_here().items()}
        log.info("%s: %d jobs in flight at the stop, %d finished, %d abandoned (uncommitted: redelivered to the next "
                 "owner); %d results published since start; %d ledger records spooled, %d still in the spool for the "
                 "next start; offsets committed: %s", "drained on stop" if self._stopping.is_set() else "stopped on a failure",
                 at_stop, max(0, at_stop - left), left, d.published, d.spooled, self.spool.known,
                 ", ".join(f"{p}={o}" for p, o in sorted(committed.items()) if o is not None) or "none")

    async def _run_tasks(self) -> None:
        assert self.deliverer is not None
        fetch = asyncio.create_task(self._fetch_loop(), name="fetch")
        dispatch = asyncio.create_task(self._dispatch_loop(), name="dispatch")
        deliver = asyncio.create_task(self.deliverer.run(), name="deliver")
        commit = asyncio.create_task(self.handover.commit_loop(), name="commit")
        gpu_time = asyncio.create_task(self._gpu_time_loop(), name="gpu-time")
        flush = asyncio.create_task(self.deliverer.flush_spool(), name="spool-flush")
        gauges = asyncio.create_task(self._gauges_loop(), name="gauges")
        tasks = [fetch, dispatch, deliver, commit, gpu_time, flush, gauges]
        refresh = self.lease.refreshing if self.lease is not None else None
        loops = {deliver, gpu_time, flush, gauges} | ({refresh} if refresh is not None else set())
        try:
            # The fetch loop ends on stop; the dispatcher then drains the queue, the deliverer the outbox.
            # The others (the lease's refresh too) never end on their own: if one does, it failed, and so does the worker.
            running = {fetch, dispatch}
            left_at: float | None = None  # when the queue was left to the next owners (the stop's deadline passed)
            stop = asyncio.create_task(self._stopping.wait(), name="stop")  # wakes the wait below: the deadline starts
            tasks.append(stop)
            while running:
                timeout = None
                if self._stopping.is_set():  # the stop's deadline, then the revoke's for what still runs, then no more
                    timeout = (self._stop_at + self.s.worker.stop_deadline_s if left_at is None
                               else left_at + self.s.worker.revoke_deadline_s + 5) - time.monotonic()
                    if left_at is None:  # looked at each second: answers the broker takes none of end the wait for the queue
                        timeout = min(timeout, 1.0)
                done, _ = await asyncio.wait(running | loops | ({stop} if not stop.done() else set()),
                                             timeout=max(0.0, timeout) if timeout is not None else None,
                                             return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
                woken = stop in done
                done.discard(stop)
                if not done and woken:
                    continue  # the stop itself woke us: wait again, now against its deadline
                if not done and left_at is None:
                    stalled = self.deliverer.stalled_for()
                    if stalled < STALL_S and time.monotonic() < self._stop_at + self.s.worker.stop_deadline_s:
                        continue
                    # With the broker taking no answers, working the queue on only adds answers that cannot go out.
                    why = (f"{len(self.deliverer.outbox)} answers have waited {stalled:.0f} s with none published (is the "
                           "broker up?)" if stalled >= STALL_S else None)
                    left_at = time.monotonic()
                    await self.handover.leave_queue_on_stop(why)
                    continue
                if not done:
                    log.warning("stopping: %d jobs still in the engine %.0f s after the queue was left; exiting without them "
                                "(uncommitted: redelivered to the next owner)", len(self._in_engine), time.monotonic() - left_at)
                    break
                for t in done:
                    t.result()
                    if t is deliver and self.deliverer.gave_up:
                        running.clear()  # stopping, and what is left can be delivered nowhere (it said so)
                    elif t in loops:
                        raise RuntimeError(f"the {t.get_name()} task stopped")
                running -= done
            await self._record_gpu_time()
            if not await self.deliverer.drain(stall_s=STALL_S):  # the broker is away: left unpublished, for the next owner
                await end_tasks([deliver])  # its batch in flight waits for the broker's acknowledgements
                await self.deliverer.leave_to_the_next_owner()
            await self.deliverer.flush_once()  # what the ledger takes now; the rest stays spooled for the next start
        finally:
            await end_tasks(tasks + ([self._refreshing] if self._refreshing is not None else []))

    # ---------------------------------------------------------------- fetch, route, queue

    async def _fetch_loop(self) -> None:
        delay = 0.1
        while not self._stopping.is_set():
            self._backpressure()
            try:
                batches = await self.consumer.getmany(timeout_ms=100, max_records=500)
            except KafkaError as e:  # the broker went away or the log moved under us: look again, never die
                if (over := stepped_over(e)) is not None:
                    tp, offset, fetch_bytes = over
                    self.intake.stepped_over(tp, offset, self.offsets.fetched(tp, offset), fetch_bytes)
                    continue
                self.metrics.fetch_errors.inc()
                log.warning("fetch failed (%s); checking the partitions' logs and retrying in %.1fs", e, delay)
                await self.partitions.check_logs()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            delay = 0.1
            if self._stopping.is_set():  # a stop during the fetch (a rebalance held it): its records stay uncommitted
                break                    # for the next owner, where they were taken, left, and counted as abandoned
            if batches:
                fetched_ns = time.monotonic_ns()
                await self.intake.ingest([(tp, m, self.offsets.fetched(tp, m.offset, batch.end if (batch := undecodable(m)) else None))
                                          for tp, messages in batches.items() for m in messages], fetched_ns)
            if time.monotonic() - self.partitions.checked_at >= self.s.worker.log_check_s:
                await self.partitions.check_logs()
            self._start_registry_refresh()

    def _backpressure(self) -> None:
        """Pause fetching while the ledger cannot take rows, while answers wait to be delivered (a broker that does not
        take them, a spool whose disk is full: the engine goes on answering the queue into them), or while too much work
        waits here: jobs queued and in the engine, and copies of them (a request id sent again while it runs) waiting for
        their first's answer."""
        w, d, parked = self.s.worker, self.deliverer, self.intake.parked
        unsent = len(d.outbox) if d is not None else 0
        jobs, tokens = len(self.scheduler) + len(self._in_engine) + parked, self.scheduler.queued_tokens + self.intake.parked_tokens
        why = ("the ledger's schema is missing or behind" if d is not None and d.schema_behind else
               f"the spool holds {self.spool.known} records" if self.spool.full else
               f"{unsent} answers wait to be published and billed" if unsent >= w.max_queued_jobs else
               f"{jobs} jobs, {tokens} tokens queued" + (f" ({parked} of them copies of a request id already here, waiting "
                                                           "for its answer)" if parked else "")
               if jobs >= w.max_queued_jobs or tokens >= w.max_queued_tokens else None)
        self.partitions.hold(why)

    def _apply_snapshot(self, snapshot: RegistrySnapshot) -> None:
        self.intake.use(snapshot)
        for t in snapshot.tenants.values():
            self.scheduler.set_policy(t.id, TenantPolicy(t.weight, t.requests_per_minute, t.tokens_per_minute))
        self._snapshot_at = time.monotonic()

    def _start_registry_refresh(self) -> None:
        """A registry refresh when one is due, as a task of its own, one at a time: the fetch loop (and Kafka's
        heartbeats, on the same event loop) never waits on the database. Read on the loop, a paused database held both
        for as long as it was paused, and the group then counted the worker as gone."""
        due = time.monotonic() - self._snapshot_at >= self.s.worker.registry_refresh_s
        if due and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh_registry(), name="registry-refresh")

    async def _refresh_registry(self) -> None:
        try:
            snapshot = await self.ledger_calls(self.registry.snapshot)
        except Exception as e:  # the database is away or does not answer: keep routing on the last snapshot
            self._snapshot_at = time.monotonic()
            self._registry_outage.failed(e)
        else:
            self._apply_snapshot(snapshot)
            self._registry_outage.ok()

    # ---------------------------------------------------------------- dispatch

    async def _dispatch_loop(self) -> None:
        """Keep the engine's slots filled in fair order; return once stopping and everything has run."""
        while True:
            free = self.capacity - len(self._in_engine)
            wait = self.scheduler.next_eligible_in()
            if wait is None and self._stopping.is_set():
                if not self._in_engine:
                    return
            # While a dead engine process is replaced (_engine_lost), jobs stay queued here rather than fail in it.
            ready = free > 0 and wait is not None and (self.aengine.alive or not isinstance(self.aengine, EngineProcess))
            batch = self.scheduler.pop_batch(resident=self._resident(), max_requests=free) if ready else []
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
                self.engine_clock.enter()
                asyncio.create_task(self._serve(p), name=f"serve-{p.payload.job.tenant_id}/{p.payload.job.request_id}")

    async def _serve(self, p: Pending) -> None:
        item: Routed = p.payload
        key = (item.job.tenant_id, item.job.request_id)
        tier = self.intake.snapshot.tenants.get(item.job.tenant_id)
        slo_tier = tier.tier if tier is not None and tier.tier in SLO_TIERS else "standard"
        used, request_back = None, False  # quota: what it ran (None: estimate); request back if unkept or abandoned (rerun)
        try:
            served = await self.feeder.serve(item, slo_tier)
        except Exception as e:  # a bug on our side, or the engine process died under its registration: fail this job alone
            error, keep = serving_error(e, key)
            used, request_back = 0, not keep or item.abandoned
            at_fault = item.route.view if error.code in ADAPTER_ERROR_CODES else None  # its files: billed on its line
            if at_fault is not None:  # the adapter's own failure, as a failed load is: it counts against its circuit
                self.breakers.record(at_fault.adapter_key, False)
            elif item.route.view is not None:  # no verdict on the adapter: a half-open probe lets the next job probe
                self.breakers.no_verdict(item.route.view.adapter_key)
            result, usage = failed_before_engine((item.job.request_id, item.job.tenant_id, item.job.batch_id), error,
                                                 datetime.now(UTC), self.worker_id, route_reason=item.route.label,
                                                 routing_us=item.route.routing_us, bill=keep, adapter=at_fault,
                                                 tier=item.tier)  # fmt: skip
            if not item.abandoned:
                self.intake.answer(key, Outcome(item.tp, item.offset, result=result, usage=usage, epoch=item.epoch), keep=keep)
        else:
            if served.adapter_key is not None:
                self.breakers.record(served.adapter_key, served.adapter_ok)
            if served.outcome is not None:
                self.intake.answer(key, served.outcome)
            used, request_back = (quota_tokens(served.outcome), False) if served.outcome is not None else (0, True)
        finally:
            if self._in_engine.pop(id(p), None) is not None:
                self.engine_clock.leave()
            self.scheduler.finished(p, used, request_back)
            if item.abandoned:
                await self.intake.orphaned(key, self.handover.revoked)
            self._work_event.set()

    async def _gpu_time_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.worker.ledger_flush_ms / 1000)
            up = self.aengine.alive
            if up or isinstance(self.aengine, EngineProcess):  # a dead process's last steps came with its last results
                await self._record_gpu_time()
            if not up:
                await self._engine_lost()
                continue
            try:
                stats = await self._engine_stats()
            except EngineError:  # the engine process died meanwhile: replaced at the next pass
                continue
            m = self.metrics
            m.memory_used.set(stats.get("lora_memory_used_bytes", 0))
            m.kv_used_blocks.set(stats.get("kv_pool_used_blocks", 0))
            m.kv_hit_rate.set(stats.get("kv_pool_hit_rate", 0.0))
            m.warm_pool_hit_rate.set(stats.get("warm_pool_hit_rate", 0.0))

    async def _engine_stats(self) -> dict:
        """The engine's gauges; an engine process that does not answer within `worker.engine_stall_s` is hung (a GPU
        or driver hang, a deadlock): it is killed, and the next pass replaces it as after a crash (`_engine_lost`)."""
        stall = self.s.worker.engine_stall_s
        if not stall or not isinstance(self.aengine, EngineProcess):
            return await self.aengine.stats()
        try:
            return await asyncio.wait_for(self.aengine.stats(), stall)
        except TimeoutError:
            log.error("the engine process %d has not answered for %.0f s (worker.engine_stall_s): killing it; its jobs in "
                      "flight are failed (engine_failed, retriable) and another starts", self.aengine.pid, stall)
            self.metrics.engine_stalls.inc()
            self.aengine.kill()
            raise EngineError("the engine process stalled and was killed", code="engine_failed", retriable=True) from None

    async def _engine_lost(self) -> None:
        """The engine process died (a crash in a CUDA library, the OOM killer): the jobs it ran were answered with
        `engine_failed` (retriable), so that a job that crashes it cannot crash it again on redelivery; start another
        and go on. A thread that died is a bug of ours: stop, and the uncommitted jobs are redelivered."""
        if not isinstance(self.aengine, EngineProcess) or not self.aengine.died:
            raise RuntimeError("the engine stopped; see the log above; its jobs will be redelivered")
        log.error("the engine process died; its jobs in flight were failed (engine_failed, retriable); starting another")
        self.metrics.engine_restarts.inc()
        await self.aengine.restart()  # raises if the new one cannot start: the worker stops
        self.feeder.forget_registrations()
        self._work_event.set()
        log.info("engine process %d started", self.aengine.pid)

    async def _record_gpu_time(self) -> None:
        """Adapter loads and busy time: the ledger's inputs for cold starts and period conservation. Written
        to the ledger, or to the spool while it is away: never dropped, but while the worker stops with neither
        taking them (a full disk), when they are logged as lost rather than holding the stop (SpoolUnavailable)."""
        loads, busy = await self.feeder.drain_gpu_time()
        for load in loads:
            self.metrics.cold_start.labels(load.tier).observe(load.load_us / 1000)
        try:
            await self.deliverer.write(loads)
            if busy is not None:
                self.engine_clock.add_steps(busy.busy_us, busy.steps)
                await self.deliverer.write([busy])
        except SpoolUnavailable as e:
            log.error("stopping: GPU-time records are lost (report reconcile will show the time as unexplained): %s", e)
        if (idle := self.engine_clock.window_idle_share()) is not None:
            self.metrics.gpu_idle.set(idle)

    async def restart_measures(self) -> None:
        """Count stages and the GPU's idle share afresh from now (`lorabatch bench pipeline`, after its warm-up): the
        steps run so far are drained first, so that none of them counts against the new span."""
        await self._record_gpu_time()
        self.engine_clock.reset()
        self.stages.kept.clear()

    async def gpu_idle_share(self) -> float | None:
        """The GPU's idle share under this worker since the start or `restart_measures` (consumer.stages)."""
        await self._record_gpu_time()
        return self.engine_clock.idle_share()

    def _resident(self) -> set[str | None]:
        # The step loop's own snapshot: asking the engine itself from the event loop would race its step.
        return set(self.aengine.resident) | {None}

    # ---------------------------------------------------------------- metrics

    async def _gauges_loop(self) -> None:
        """The gauges every GAUGES_S until the worker exits: refreshed by the fetch loop alone, which ends at the stop,
        they stayed at their value at the stop through a drain (176 in flight and 160 queued for 15 s while 88 jobs
        finished), and never came down to 0."""
        while True:
            self._gauges()
            await asyncio.sleep(GAUGES_S)

    def _gauges(self) -> None:
        m = self.metrics
        depth = self.scheduler.depth_by_tenant()
        for tenant in self.intake.snapshot.tenants:  # registered tenants only: a bounded label set
            m.queue_depth.labels(tenant).set(depth.get(tenant, 0))
        m.in_flight.set(self.offsets.in_flight())
        self.intake.dlq_log.flush()  # the count of a burst of DLQ records, once due, whether or not more follow
        m.circuit_open.set(len(self.breakers.open_circuits()))
        errors = getattr(self.router.cache, "errors", 0)
        if errors > self._cache_errors_seen:
            m.route_cache_errors.inc(errors - self._cache_errors_seen)
            if self._cache_errors_throttle.due():  # a line a minute at most while the cache fails
                log.warning("the route cache (Redis) failed %d times since the last line (%d in all); routing goes on by "
                            "the tenants' rules and defaults (lora_route_cache_errors_total); the latest: %s",
                            errors - self._cache_errors_said, errors, getattr(self.router.cache, "last_error", "") or "?")
                self._cache_errors_said = errors
            self._cache_errors_seen = errors
        self.partitions.report_lag()
