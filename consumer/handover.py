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

from consumer.delivery import STALL_S
from consumer.feeder import Routed
from consumer.kafka import commit_in_generation, membership_lost
from consumer.scheduler import Pending

if TYPE_CHECKING:
    from consumer.worker import Worker

log = logging.getLogger("lorabatch.worker")

# A commit or a leave the group coordinator does not answer is given up after these: a member stuck rejoining after a
# rebalance storm saw its commits hang and its exit wait past a SIGTERM's minute (tests/test_chaos.py, under load).
COMMIT_TIMEOUT_S = 10.0
LEAVE_TIMEOUT_S = 15.0
COMMIT_SAY_S = 30.0  # while commits fail in a row, one line about them this often (`_commit_failed`)


class Handover:
    """The worker's side of its group membership. `in_engine`: the worker's jobs in the engine, by engine id."""

    def __init__(self, worker: Worker, in_engine: dict[int, tuple[Pending, Routed]]):
        self.w = worker
        self.in_engine = in_engine
        self.revoked: set[TopicPartition] = set()  # of the latest rebalance
        self._left = False  # the consumer was stopped (`leave`)
        self._unanswered = False  # the last commit got no answer within COMMIT_TIMEOUT_S (a broker dead or frozen)
        self._failing_since: float | None = None  # monotonic, the first of the commits failing in a row
        self._failed = 0  # commits failed in a row
        self._said_at = 0.0  # monotonic, when the last line about them was written

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
        if self._unanswered and self.w.stopping:
            # A stop waits for one unanswered commit, not one per step of its way out (on a revoke, at the end: with the
            # broker dead, 10 s each, past a 30 s grace period); what stays uncommitted is redelivered.
            return
        try:
            sent = await asyncio.wait_for(commit_in_generation(self.w.consumer, offsets), COMMIT_TIMEOUT_S)
        except (KafkaError, TimeoutError) as e:
            self._unanswered = isinstance(e, TimeoutError)
            self._commit_failed(offsets, str(e) if isinstance(e, KafkaError) else f"no answer in {COMMIT_TIMEOUT_S:.0f} s")
            return
        if not sent:
            # The group dropped this worker (or a restarted broker forgot it): these marks are of a generation that is
            # gone, and the revoke of its rejoin drops them (`on_revoked`, lost). Committed now, unfenced, they landed on
            # a restarted memory-only broker's new log and skipped its first jobs (commit_in_generation says how).
            return
        self._unanswered = False
        if self._failing_since is not None:
            log.warning("commits succeed again, after %d failed in a row over %.0f s", self._failed,
                        time.monotonic() - self._failing_since)
            self._failing_since, self._failed = None, 0
        self.w.offsets.mark_committed(offsets)
        self.w.stages.committed(offsets)

    def _commit_failed(self, offsets: dict, why: str) -> None:
        """Count a failed commit (`lorabatch_retries_total{what="commit"}`) and say so: the first of a run in full, then
        one line every COMMIT_SAY_S with how many failed since; a commit is tried every worker.commit_interval_ms, and a
        line for each (5 a second by default) filled the log while a rebalancing group or a dead broker refused them."""
        now = time.monotonic()
        self._failed += 1
        self.w.metrics.retries.labels("commit").inc()
        stopping = self._unanswered and self.w.stopping
        then = ("stopping: not committing again (the offsets stay uncommitted, redelivered to the partitions' next "
                "owner)" if stopping else "the next commit retries")
        if self._failing_since is None:
            self._failing_since = self._said_at = now
            log.warning("commit of %s failed: %s; %s", offsets, why, then)
        elif stopping or now - self._said_at >= COMMIT_SAY_S:
            self._said_at = now
            log.warning("commits failing for %.0f s, %d in a row; the last, of %d partitions' offsets: %s; %s",
                        now - self._failing_since, self._failed, len(offsets), why, then)

    async def leave(self) -> None:
        """Stop the consumer (it leaves the group), within LEAVE_TIMEOUT_S: a member whose rejoin the coordinator never
        answers would otherwise hang the exit (seen with Tansu after a rebalance storm); the broker then drops the
        membership itself when its session times out, and the uncommitted offsets are redelivered."""
        if self._left:
            return
        self._left = True
        consumer = self.w.consumer
        try:
            await asyncio.wait_for(consumer.stop(), LEAVE_TIMEOUT_S)
        except TimeoutError:
            log.warning("the consumer did not leave its group within %.0f s (the coordinator does not answer); exiting "
                        "without it: the broker drops the membership when its session times out", LEAVE_TIMEOUT_S)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the worker itself is cancelled
            # aiokafka 0.14's fetcher.close awaits the fetch tasks it cancelled: one waiting out a retry (the broker away)
            # raises CancelledError out of stop() before the client's connections are closed. The worker then ended
            # with that traceback instead of its exit, and the client went on dialling the dead broker.
            log.info("the consumer's fetcher stopped mid-retry (the broker is away); closing its connections")
            await asyncio.wait_for(consumer._client.close(), LEAVE_TIMEOUT_S)

    async def leave_queue_on_stop(self, why: str | None = None) -> None:
        """The stop's deadline passed with jobs still queued or running: treat every partition as revoked (queued jobs
        are dropped; running ones get worker.revoke_deadline_s, then are aborted; what finished is committed), so a
        worker with a deep queue exits within a grace period an orchestrator gives, and loses nothing: what it leaves
        is uncommitted and redelivered to the partitions' next owner. Bounded even if the engine answers nothing."""
        queued, running = len(self.w.scheduler), len(self.in_engine)
        log.warning("stopping: %s with %d jobs queued and %d in the engine; leaving them to the partitions' next owner",
                    why or f"worker.stop_deadline_s={self.w.s.worker.stop_deadline_s:.0f} passed", queued, running)
        try:
            await asyncio.wait_for(self.on_revoked(set(self.w.offsets.partitions()), forget=False),
                                   self.w.s.worker.revoke_deadline_s + 5)
        except TimeoutError:
            log.warning("stopping: the engine did not give back its jobs within worker.revoke_deadline_s + 5 s")

    async def on_revoked(self, revoked: set[TopicPartition], *, forget: bool = True, lost: bool = False) -> int:
        """Leave the revoked partitions' queued jobs to the new owner, let what runs for them finish within the deadline
        and commit it; abandon the rest (aborted in the engine, its results unpublished, its offsets uncommitted: the new
        owner redoes it). `forget` False (a stop: the partitions stay ours until the worker leaves) keeps their offsets
        and leaves their commit to the stop's last one, which covers what is delivered after. `lost`: the group dropped
        this worker (its session expired) and another member already runs these partitions from their committed offsets:
        what runs is aborted at once and nothing is committed (Handover.commit sends none until the rejoin: see
        commit_in_generation). Returns how many jobs it left (dropped or aborted)."""
        deadline = time.monotonic() + (0.0 if lost else self.w.s.worker.revoke_deadline_s)
        self.revoked = set(revoked)
        # The queue first: a place in the engine freed while the running jobs finish must not take one of these.
        dropped = self.w.scheduler.drop(set(revoked))
        for p in dropped:  # queued, never run: the new owner answers them, and the copies that waited here
            item = p.payload
            key = (item.job.tenant_id, item.job.request_id)
            item.abandoned = True
            await self.w.intake.orphaned(key, revoked)
        if dropped and not lost:
            log.info("rebalance: %d queued jobs of revoked partitions left to their next owner", len(dropped))

        def revoked_running() -> list[Routed]:
            return [r for _, r in self.in_engine.values() if r.tp in revoked]

        def undeliverable() -> bool:  # answers the broker takes none of: what still runs could not go out either
            return self.w.deliverer is not None and self.w.deliverer.stalled_for() >= STALL_S

        while revoked_running() and time.monotonic() < deadline and not undeliverable():
            await asyncio.sleep(0.02)
        aborted = revoked_running()
        for item in aborted:  # all marked before the first abort's round trip
            item.abandoned = True
        if lost:
            # A worker frozen past its session (SIGSTOP, a paused VM, a starved host) wakes here, on its next heartbeat.
            # Without this it gave what ran worker.revoke_deadline_s more, publishing and billing work that the
            # partitions' new owner was already redoing, then logged the commit the broker refused as "the next commit
            # retries". Said before the aborts: each is a round trip between engine steps (64 took 8 s on the CPU demo).
            log.warning("lost partitions %s: the group dropped this worker (no heartbeat for kafka.session_timeout_ms = "
                        "%.0f s: the process was frozen or starved; or the broker restarted and forgot the group) and gave "
                        "them to another member; %d queued and %d "
                        "running jobs left to it uncommitted (it runs and bills them), nothing committed for them; "
                        "rejoining the group", ", ".join(f"{tp.topic}:{tp.partition}" for tp in sorted(revoked)),
                        self.w.s.kafka.session_timeout_ms / 1000, len(dropped), len(aborted))
            self.w.metrics.partitions_lost.inc(len(revoked))
        for item, outcome in zip(aborted, await asyncio.gather(
                *(self.w.aengine.abort(item.job.request_id, tenant_id=item.job.tenant_id) for item in aborted), return_exceptions=True)):  # fmt: skip
            if isinstance(outcome, Exception):  # a dead engine has failed its jobs already
                log.warning("rebalance: aborting %s/%s failed: %s", item.job.tenant_id, item.job.request_id, outcome)
        if lost:
            if forget:
                self.w.offsets.forget(revoked)
                self.w.stages.forget(revoked)
            return len(aborted) + len(dropped)
        if self.w.deliverer is not None:
            try:
                drained = await asyncio.wait_for(self.w.deliverer.drain(stall_s=STALL_S),
                                                 timeout=max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                drained = False
            if not drained:
                log.warning("rebalance: revoked work not delivered within the deadline%s; it will be redelivered",
                            " (the broker takes no answers)" if undeliverable() else "")
        if forget:  # a stop's (forget False) are committed by its last commit, once (with the broker dead, 10 s each)
            await self.commit(only=set(revoked))
            self.w.offsets.forget(revoked)
            self.w.stages.forget(revoked)
        return len(aborted) + len(dropped)


class Rebalance(ConsumerRebalanceListener):
    def __init__(self, handover: Handover):
        self.handover = handover

    async def on_partitions_revoked(self, revoked):
        await self.handover.on_revoked(set(revoked), lost=membership_lost(self.handover.w.consumer))

    async def on_partitions_assigned(self, assigned):
        log.info("assigned %s", sorted((tp.topic, tp.partition) for tp in assigned))
