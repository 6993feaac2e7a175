"""Feeding the engine continuously: routed jobs join its running batch as slots free up.

The engine steps in its own process (`engine.engine_process.EngineProcess`) or thread
(`engine.async_engine.AsyncEngine`), with the same face; each job here is one awaited
`generate`, so a job joins between two engine steps and leaves when it finishes, whatever else runs.
Adapters are registered with the engine by adapter_key on first sight (metadata only: the engine's pool
loads them from the store, tiered, when a request needs them). Load events and the steps' measured
busy time are drained from the engine periodically and written to the ledger.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from aiokafka import TopicPartition

from billing.periods import period_of
from billing.records import AdapterLoadRecord, BusyRecord
from consumer.delivery import Outcome
from consumer.outcomes import Served, succeeded_or_failed, to_request
from consumer.registry import AdapterView
from consumer.routing import Route
from consumer.schemas import Job
from consumer.stages import Stamps
from engine.api import ADAPTER_ERROR_CODES, EngineError
from engine.async_engine import AsyncEngine, charged_us
from engine.engine_process import EngineProcess
from engine.store import AdapterStore

log = logging.getLogger("lorabatch.worker")



@dataclass
class Routed:
    job: Job
    route: Route
    tp: TopicPartition
    offset: int
    received_at: datetime  # when the worker took the job from its partition (its queue time starts there)
    received_mono_us: int
    abandoned: bool = False  # its partition was revoked: its result must not be published
    epoch: int | None = None  # of its partition's log (consumer/offsets.py)
    stamps: Stamps | None = None  # its way through the worker (consumer.stages)
    tier: str | None = None  # its tenant's tier in the registry snapshot it was routed with: its row's token price list


def _utc_now() -> datetime:
    return datetime.now(UTC)


class EngineFeeder:
    """Runs routed jobs on the engine and turns what it measured into ledger records.

    A request's usage row is stamped with the instant its result reached the worker (its GPU work finished): that
    instant's month bills it, at that instant's prices. A busy record belongs to its started_at's month, so the busy
    time of requests still running when a record crosses a month's end is measured in one month and billed in a later
    one. The feeder keeps, per month, the busy time it recorded less the time of the rows it stamped in that month
    (and the unbilled time it named there); what is left when a record crosses into a new month is that carried time,
    named on the record (BusyRecord.carried_us) and owed by the month of its ended_at, where those requests finish.
    """

    def __init__(self, aengine: AsyncEngine | EngineProcess, store: AdapterStore, worker_id: str, gpu_kind: str,
                 slo_tiers: dict[str, str] | None = None, clock: Callable[[], datetime] = _utc_now):
        self.aengine = aengine
        self.store = store
        self.worker_id = worker_id
        self.gpu_kind = gpu_kind
        self._registered: dict[str, str] = {}  # adapter_key -> sha256
        self._adapters: dict[str, AdapterView] = {}
        self._clock = clock  # the worker's wall clock, UTC: stamps finished requests
        self._since = clock()
        self._stamped = self._since  # the latest instant a row was stamped with (see drain_gpu_time)
        self._unbilled_us = 0  # measured time of jobs abandoned on a revoke: on the next busy record, as unbilled
        # Month -> busy µs recorded (or carried) into it less the µs of the rows stamped in it and the unbilled µs named
        # there: the current record's month and any later one a row was stamped in before a record reached it.
        self._owed: dict[str, int] = {}
        self.slo_tiers = slo_tiers or {}

    async def register(self, a: AdapterView, slo_tier: str) -> None:
        if self._registered.get(a.adapter_key) == a.sha256:
            return
        path = self.store.path(a.sha256)
        await self.aengine.call(functools.partial(_ensure_registered, key=a.adapter_key, path=path, sha256=a.sha256,
                                                  tenant_id=a.tenant_id, slo_tier=slo_tier))  # fmt: skip
        self._registered[a.adapter_key] = a.sha256
        self._adapters[a.adapter_key] = a

    def forget_registrations(self) -> None:
        """The engine was replaced (a restarted engine process knows no adapter): register each again on first use."""
        self._registered.clear()

    async def serve(self, item: Routed, slo_tier: str) -> Served:
        a = item.route.view
        adapter_key = a.adapter_key if a is not None else None
        unreadable = False  # the adapter's own files failed its registration, and the job may run on the base
        if a is not None:
            try:
                await self.register(a, slo_tier)
            except EngineError as e:  # (a store folder gone or damaged under the registry): as a load that fails
                if e.code not in ADAPTER_ERROR_CODES or not item.job.allow_base_fallback:
                    raise
                log.warning("adapter %s cannot be registered, job %s/%s runs on the base model: %s", a.adapter,
                            item.job.tenant_id, item.job.request_id, e)  # fmt: skip
                unreadable = True
        request = to_request(item.job, None if unreadable else adapter_key, item.received_mono_us)
        res = await self.aengine.generate(request)
        if item.stamps is not None:
            item.stamps.served_now(res.timings.queue_us)
        fell_back = res.base_fallback or unreadable
        # Only the adapter's own failures count against its circuit: a caller's bad request, another
        # request's fault or an engine failure says nothing about the adapter.
        ok = not fell_back and (res.error is None or res.error.code not in ADAPTER_ERROR_CODES)
        if item.abandoned:  # its partition was revoked: the new owner runs and bills it again
            self._unbilled_us += charged_us(res)
            return Served(None, adapter_key, ok)
        ran_on = a if a is not None and not fell_back else None
        label = item.route.label
        if a is not None and fell_back:
            label = f"base_fallback ({a.adapter} failed to load)"
        # Never before the open busy record's start (an engine process's record may end a decode round's head start,
        # µs, past the clock; a host clock may step back): a row is never stamped in a month already carried. No await
        # from here to the tally: a drain never runs between the two.
        finished_at = max(self._clock(), self._since)
        result, usage = succeeded_or_failed(
            item.job, res, self.worker_id, adapter=ran_on.adapter if ran_on else None, adapter_sha256=ran_on.sha256 if ran_on else None,
            route_reason=label, routing_us=item.route.routing_us, finished_at=finished_at, tier=item.tier,
        )
        self._bill(finished_at, charged_us(res))
        self._stamped = max(self._stamped, finished_at)
        return Served(Outcome(item.tp, item.offset, result=result, usage=usage, epoch=item.epoch, stamps=item.stamps), adapter_key, ok)

    async def drain_gpu_time(self) -> tuple[list[AdapterLoadRecord], BusyRecord | None]:
        """Adapter loads and measured busy time since the last call, as ledger records."""
        # Every step popped ended before `now` and began after the previous drain (each host says how it keeps that),
        # but for an engine process's decode round left running: see below.
        events, busy_us, steps, now, unbilled_us = await self.aengine.pop_gpu_time()
        unbilled_us, self._unbilled_us = unbilled_us + self._unbilled_us, 0
        loads = []
        for ev in events:
            a = self._adapters.get(ev.key)  # the pool's load events name the adapter_key `key`
            if a is None or ev.error_code or ev.skip_reason or ev.load_us <= 0:
                continue  # a failed or skipped load read nothing billable; an unknown key is the engine's own
            loads.append(AdapterLoadRecord(adapter=a.adapter, adapter_sha256=a.sha256, tenant_id=a.tenant_id, tier=ev.tier,
                                           nbytes=ev.nbytes, load_us=ev.load_us, worker_id=self.worker_id, created_at=now,
                                           gpu_kind=self.gpu_kind))
        busy = None
        now = max(now, self._since)  # a host's clock stands still while no step is reported: never step back
        if period_of(self._stamped) != period_of(now):
            # A result reached the worker in a later month than the host's clock reads: an engine process's clock is
            # its last pass's, and stands still while no step runs, so a result of a pass just before midnight is
            # stamped after it while every record that follows would end before it, and the month's busy time the
            # row bills would never be carried. The record ends at the row's stamp instead: it crosses, and carries.
            now = max(now, self._stamped)
        month = period_of(self._since)
        self._owed[month] = owed = self._owed.get(month, 0) + busy_us - unbilled_us
        crossing = period_of(now) != month  # (then now is past the record's start: no 1 µs rule below)
        if not steps and unbilled_us and not crossing:  # no step since the last record: its clock may be that record's;
            now = self._since + timedelta(microseconds=1)  # 1 µs on keeps (worker_id, started_at), the key, unique
        carried_us = 0
        if steps or unbilled_us or (crossing and owed):
            # An engine process leaves a decode round running past the clock it reports (EngineProcess.pop_gpu_time),
            # so a record's steps may pass its wall span by that round's head start (a read-back's host time). Such a
            # record ends that much later (the next one starts there): no record claims more busy time than its span,
            # which the ledger refuses, and no µs is moved or lost.
            now = max(now, self._since + timedelta(microseconds=max(busy_us, 1)))  # 1 µs on at least: keys stay unique
            if period_of(now) != month:  # the month's last record: what the month's rows do not bill is carried
                carried_us = self._carry(month, period_of(now))
            busy = BusyRecord(worker_id=self.worker_id, gpu_kind=self.gpu_kind, started_at=self._since, ended_at=now,
                              busy_us=busy_us, steps=steps, unbilled_us=unbilled_us, carried_us=carried_us)
        elif crossing:
            self._carry(month, period_of(now))  # nothing owed: no record needed to say so
        self._since = now
        return loads, busy

    def _bill(self, finished_at: datetime, charged: int) -> None:
        """A usage row stamped `finished_at` bills `charged` µs of busy time to its month."""
        month = period_of(finished_at)
        self._owed[month] = self._owed.get(month, 0) - charged

    def _carry(self, month: str, into: str) -> int:
        """Close `month` off: its busy time that its rows do not bill (requests still running, and those finished
        since it ended) moves to `into`, the month of the record's end. Returns the µs carried."""
        owed = self._owed.pop(month, 0)
        if owed < 0:  # more billed than measured: a result whose steps were not drained yet (an engine host's fault)
            log.warning("month %s: the rows stamped in it bill %d us more than its busy records measured; report "
                        "reconcile will show it unexplained", month, -owed)
            owed = 0
        self._owed[into] = self._owed.get(into, 0) + owed
        return owed


# The engine-side half of `register`: module-level, so that it pickles to an engine in its own process
# (engine.engine_process), and runs there between two steps.


def _ensure_registered(e, key: str, path, sha256: str, tenant_id: str, slo_tier: str) -> None:
    """Register `key` unless it is already registered with this content (no other registration interleaves)."""
    if e.has_adapter(key):
        if e.adapters.sha_of(key) in (None, sha256):
            return
        e.unload_adapter(key)  # the key now names other content (a registry rebuilt under it)
    e.register_adapter(key, path, sha256=sha256, tenant_id=tenant_id, slo_tier=slo_tier)
