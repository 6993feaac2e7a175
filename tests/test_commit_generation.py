"""A commit goes out only under the group generation the worker holds: offsets marked under one the group no longer
has are never committed. Real broker (a memory-only Tansu, killed and started again on its port), real aiokafka
consumer, the worker's own Handover; the order of the race is held by the test, not left to timing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from consumer.broker import EmbeddedBroker, free_port
from consumer.config import load_settings
from consumer.handover import Rebalance
from consumer.kafka import membership_lost
from consumer.registry import RegistrySnapshot
from consumer.worker import Worker
from engine.config import EngineConfig

TP = TopicPartition("jobs", 1)


class _HeldRevoke(Rebalance):
    """The worker's listener, held in the revoke that follows a lost membership (as the worker's is while it aborts what
    runs or drains what finished): aiokafka sends its JoinGroup only after it returns, so the restarted broker does not
    know the group meanwhile."""

    def __init__(self, handover):
        super().__init__(handover)
        self.lost, self.release = asyncio.Event(), asyncio.Event()

    async def on_partitions_revoked(self, revoked):
        if revoked and membership_lost(self.handover.w.consumer):  # not the first join's (nothing held, no generation)
            self.lost.set()
            await self.release.wait()
        await super().on_partitions_revoked(revoked)


async def _produce(bootstrap: str, n: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for i in range(n):
            await producer.send_and_wait(TP.topic, f"job {i}".encode(), partition=TP.partition)
    finally:
        await producer.stop()


async def _fetched(consumer: AIOKafkaConsumer, upto: int) -> list[int]:
    """The offsets of TP fetched until one at or past `upto` comes."""
    offsets: list[int] = []
    while not offsets or offsets[-1] < upto:
        batches = await consumer.getmany(TP, timeout_ms=500)
        offsets += [m.offset for m in batches.get(TP, [])]
    return offsets


async def test_a_commit_the_restarted_broker_would_take_from_a_dropped_member_is_not_sent(tmp_path):
    """Invariant: every job of the new log is read after a memory-only broker's restart, whatever the worker had marked
    on the old one. The worker read jobs:1 offset 0 on the old log; its commit of 1 did not go out before the broker
    died. On the restarted broker the log holds three new jobs (0, 1, 2) and the group is unknown: the first commit is
    refused (an unknown member) and aiokafka resets the generation to -1; a commit made then, while the revoke holds the
    rejoin, went out as a plain commit (generation -1), the broker took it, and the group read jobs:1 from 1: job 0 of
    the new log was never run (one full-suite run in four, tests/test_audit_c.py). Now it is not sent, and the rejoined
    group reads the new log from 0."""
    port = free_port()
    first = EmbeddedBroker(port, log_path=tmp_path / "tansu-1.log")
    second = EmbeddedBroker(port, log_path=tmp_path / "tansu-2.log")
    await asyncio.to_thread(first.start, [TP.topic], 2)
    s = load_settings(None, {"worker.spool_path": str(tmp_path / "spool.sqlite")})
    w = Worker(s, SimpleNamespace(config=EngineConfig(max_batch_size=32)),
               SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=SimpleNamespace(root=tmp_path)),
               ledger=None)
    w.aengine = SimpleNamespace(abort=None)  # nothing runs: the revoke aborts nothing
    consumer = w.consumer = AIOKafkaConsumer(bootstrap_servers=first.bootstrap, group_id="workers", group_instance_id="w1",
                                             enable_auto_commit=False, auto_offset_reset="earliest")
    listener = _HeldRevoke(w.handover)
    consumer.subscribe([TP.topic], listener=listener)
    try:
        await _produce(first.bootstrap, 1)
        await consumer.start()
        assert await asyncio.wait_for(_fetched(consumer, 0), 60) == [0]
        w.offsets.finished(TP, 0, w.offsets.fetched(TP, 0))
        assert w.offsets.committable() == {TP: 1}

        first.process.kill()
        first.process.wait(10)
        await asyncio.to_thread(second.start, [TP.topic], 2)
        await _produce(second.bootstrap, 3)
        for _ in range(100):  # the restarted broker refuses the old member's commits (or heartbeat): the generation resets
            if membership_lost(consumer):
                break
            await w.handover.commit()
            await asyncio.sleep(0.1)
        await asyncio.wait_for(listener.lost.wait(), 30)
        assert w.offsets.committable() == {TP: 1}, "the old marks are still there while the revoke is held"

        await w.handover.commit()  # the commit loop's next turn, before the revoke drops the marks
        listener.release.set()
        assert await asyncio.wait_for(_fetched(consumer, 2), 60) == [0, 1, 2], "the new log is read from its start"
        assert w.offsets.committable() == {}, "the revoke dropped the old generation's marks"
    finally:
        await consumer.stop()
        second.stop()
        first.stop()
