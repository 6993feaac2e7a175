"""Handing partitions over: the worker's commits, the jobs of partitions a rebalance takes away, and leaving the group.

A partition's work changes hands by its committed offset: what this worker finished is committed (`commit`, every
`worker.commit_interval_ms`, bounded by COMMIT_TIMEOUT_S), and what it has not finished is left uncommitted, for the
partition's next owner to fetch again. On a revoke (`on_revoked`, from the consumer's rebalance listener) its queued
jobs are dropped at once, its running ones get `worker.revoke_deadline_s` to finish and are then aborted, and what
finished is delivered and committed before the partitions go. A stop whose deadline passed hands every partition over
the same way (`leave_queue_on_stop`), and `leave` then takes the consumer out of the group, bounded by
LEAVE_TIMEOUT_S. The ledger's (tenant, request_id) key keeps a job run again by the next owner from being billed twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from aiokafka import ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError

from consumer.feeder import Routed
from consumer.scheduler import Pending

if TYPE_CHECKING:
    from consumer.worker import Worker

log = logging.getLogger("lorabatch.worker")

# A commit or a leave the group coordinator does not answer is given up after these: a member stuck rejoining after a
# rebalance storm saw its commits hang and its exit wait past a SIGTERM's minute (tests/test_chaos.py, under load).
COMMIT_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 15.0


class Handover:
    """The worker's side of its group membership. `in_engine`: the worker's jobs in the engine, by engine id."""

    def __init__(self, worker: Worker, in_engine: dict[int, tuple[Pending, Routed]]):
        self.w = worker
        self.in_engine = in_engine
        self.revoked: set[TopicPartition] = set()  # of the latest rebalance
        self._left = False  # the consumer was stopped (`leave`)

    async def commit_loop(self) -> None:
        while True:
            await asyncio.sleep(self.w.s.worker.commit_interval_ms / 1000)
            await self.commit()

    async def commit(self, only: set | None = None) -> None:
        offsets = self.w.offsets.committable()
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        try:
            await asyncio.wait_for(self.w.consumer.commit(offsets), COMMIT_TIMEOUT_S)
        except (KafkaError, TimeoutError) as e:
            why = str(e) if isinstance(e, KafkaError) else f"no answer in {COMMIT_TIMEOUT_S:.0f} s"
            log.warning("commit of %s failed: %s; the next commit retries", offsets, why)
            return
        self.w.offsets.mark_committed(offsets)
        self.w.stages.committed(offsets)

    async def leave(self) -> None:
        """Stop the consumer (it leaves the group), within LEAVE_TIMEOUT_S: a member whose rejoin the coordinator never
        answers would otherwise hang the exit (seen with Tansu after a rebalance storm); the broker then drops the
        membership itself when its session times out, and the uncommitted offsets are redelivered."""
        if self._left:
            return
        self._left = True
        try:
            await asyncio.wait_for(self.w.consumer.stop(), LEAVE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the consumer did not leave its group within %.0f s (the coordinator does not answer); exiting "
                        "without it: the broker drops the membership when its session times out", LEAVE_TIMEOUT_S)

    async def leave_queue_on_stop(self) -> None:
        """The stop's deadline passed with jobs still queued or running: treat every partition as revoked (queued jobs
        are dropped; running ones get worker.revoke_deadline_s, then are aborted; what finished is committed), so a
        worker with a deep queue exits within a grace period an orchestrator gives, and loses nothing: what it leaves
        is uncommitted and redelivered to the partitions' next owner. Bounded even if the engine answers nothing."""
        queued, running = len(self.w.scheduler), len(self.in_engine)
        log.warning("stopping: worker.stop_deadline_s=%.0f passed with %d jobs queued and %d in the engine; leaving them "
                    "to the partitions' next owner", self.w.s.worker.stop_deadline_s, queued, running)
        try:
            await asyncio.wait_for(self.on_revoked(set(self.w.offsets.partitions()), forget=False),
                                   self.w.s.worker.revoke_deadline_s + 5)
        except TimeoutError:
            log.warning("stopping: the engine did not give back its jobs within worker.revoke_deadline_s + 5 s")

    async def on_revoked(self, revoked: set[TopicPartition], *, forget: bool = True) -> int:
        """Leave the revoked partitions' queued jobs to the new owner, let what runs for them finish within the deadline
        and commit it; abandon the rest (aborted in the engine, its results unpublished, its offsets uncommitted: the new
        owner redoes it). `forget` False (a stop: the partitions stay ours until the worker leaves) keeps their offsets,
        so the last commit covers what is delivered after. Returns how many jobs it left (dropped or aborted)."""
        deadline = time.monotonic() + self.w.s.worker.revoke_deadline_s
        self.revoked = set(revoked)
        # The queue first: a place in the engine freed while the running jobs finish must not take one of these.
        dropped = self.w.scheduler.drop(set(revoked))
        for p in dropped:  # queued, never run: the new owner answers them, and the copies that waited here
            item = p.payload
            key = (item.job.tenant_id, item.job.request_id)
            item.abandoned = True
            await self.w.intake.orphaned(key, revoked)
        if dropped:
            log.info("rebalance: %d queued jobs of revoked partitions left to their next owner", len(dropped))

        def revoked_running() -> list[Routed]:
            return [r for _, r in self.in_engine.values() if r.tp in revoked]

        while revoked_running() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        aborted = revoked_running()
        for item in aborted:  # all marked before the first abort's round trip
            item.abandoned = True
        for item, outcome in zip(aborted, await asyncio.gather(
                *(self.w.aengine.abort(item.job.request_id, tenant_id=item.job.tenant_id) for item in aborted), return_exceptions=True)):  # fmt: skip
            if isinstance(outcome, Exception):  # a dead engine has failed its jobs already
                log.warning("rebalance: aborting %s/%s failed: %s", item.job.tenant_id, item.job.request_id, outcome)
        if self.w.deliverer is not None:
            try:
                await asyncio.wait_for(self.w.deliverer.drain(), timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("rebalance: revoked work not delivered within the deadline; it will be redelivered")
        await self.commit(only=set(revoked))
        if forget:
            self.w.offsets.forget(revoked)
            self.w.stages.forget(revoked)
        return len(aborted) + len(dropped)


class Rebalance(ConsumerRebalanceListener):
    def __init__(self, handover: Handover):
        self.handover = handover

    async def on_partitions_revoked(self, revoked):
        await self.handover.on_revoked(set(revoked))

    async def on_partitions_assigned(self, assigned):
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))
