"""A spool file another process holds locked (`sqlite3 spool.sqlite 'BEGIN EXCLUSIVE;'` left open, a second worker of a
shared spool mid-transaction) never stalls the worker's event loop: a write waits in its thread for SQLite's busy
timeout (30 s), holding the spool's lock, and the fetch loop's look at the spool's size (`full`, every 100 ms) and each
delivery's (`Deliverer.write`) then waited on that lock on the loop, stopping heartbeats, fetches, deliveries and SIGTERM
for as long. The loop reads the last count instead (`Spool.known`); counts are made off the loop."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from types import SimpleNamespace

from aiokafka import TopicPartition

from billing.errors import LedgerUnavailableError
from consumer.config import KafkaConfig
from consumer.delivery import Deliverer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.spool import Spool
from consumer.worker import Worker
from tests.test_ledger_refusals import Producer
from tests.test_spool import _usage

HOLD_S = 3.0


def _hold_lock(path, seconds: float = HOLD_S) -> subprocess.Popen:
    """Another process holding the spool file's write lock for `seconds`, as `sqlite3 FILE 'BEGIN EXCLUSIVE;'` does."""
    code = ("import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN EXCLUSIVE')\n"
            "print('held', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n"
            "db.execute('COMMIT')\n")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path), str(seconds)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


async def _longest_stall(during) -> float:
    """The longest gap between the ticks of a 20 ms task while `during()` runs on the same loop."""
    gaps, stop = [], asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(0.02)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        await during()
    finally:
        stop.set()
        await tick
    return max(gaps)


class _Down:
    """A ledger that is unreachable: every record is spooled."""

    def record_usage(self, records):
        raise LedgerUnavailableError("the ledger is down (test)")

    record_busy = record_adapter_loads = record_usage

    def ping(self):
        raise LedgerUnavailableError("the ledger is down (test)")


def _deliverer(spool: Spool) -> Deliverer:
    offsets = OffsetTracker()
    offsets.fetched(TopicPartition("jobs", 0), 0)
    return Deliverer(KafkaConfig(), Producer(), _Down(), offsets, WorkerMetrics(), "w1", lambda t: True, spool,  # type: ignore[arg-type]
                     flush_s=0.01)


async def test_the_fetch_loops_look_at_a_locked_spool_does_not_stall_the_loop(tmp_path) -> None:
    """A write waiting on the other process's lock in its thread; meanwhile the fetch loop asks `full` every 100 ms, as
    `_backpressure` does: the loop's other tasks tick on, and once the lock goes the write lands and is counted."""
    spool = Spool(tmp_path / "spool.sqlite", max_records=3)
    spool.put([_usage(0)])
    holder = _hold_lock(spool.path)
    try:
        seen = []

        async def fetch_loop() -> None:
            write = asyncio.create_task(asyncio.to_thread(spool.put, [_usage(1), _usage(2)]))
            await asyncio.sleep(0.1)  # the write holds the spool's lock, waiting on the file's
            for _ in range(10):
                seen.append(spool.full)
                await asyncio.sleep(0.1)
            await write

        assert await _longest_stall(fetch_loop) < 0.5
        assert seen == [False] * 10  # the last count (1), while the file cannot be counted
    finally:
        holder.wait()
    assert spool.known == 3 and spool.full and len(spool) == 3
    spool.close()


async def test_a_delivery_to_a_locked_spool_does_not_stall_the_loop(tmp_path) -> None:
    """The ledger down and records already spooled: a delivery's writes go to the spool behind them. With the file
    locked by another process, the second write's look at the spool waited on the first's thread, on the loop."""
    spool = Spool(tmp_path / "spool.sqlite", max_records=1000)
    d = _deliverer(spool)
    await d.write([_usage(0)])
    assert d.ledger_down is not None and len(spool) == 1
    holder = _hold_lock(spool.path)
    try:
        async def deliveries() -> None:
            first = asyncio.create_task(d.write([_usage(1)]))
            await asyncio.sleep(0.1)
            await asyncio.gather(first, d.write([_usage(2)]), d.write([_usage(3)]))

        assert await _longest_stall(deliveries) < 0.5
    finally:
        holder.wait()
    ids = [r.request_id for r in spool.oldest(10)[2]]
    # r2 and r3 are written at once (one gather): either may take the file first, behind r0 and r1.
    assert ids[:2] == ["r0", "r1"] and sorted(ids[2:]) == ["r2", "r3"], ids
    assert spool.known == 4 and d.metrics.spool_records._value.get() == 4
    spool.close()


def test_backpressure_reads_the_last_count(tmp_path) -> None:
    """`Worker._backpressure` (every turn of the fetch loop) says the spool full from its last count, without counting."""
    spool = Spool(tmp_path / "spool.sqlite", max_records=2)
    spool.put([_usage(0), _usage(1)])
    held = []

    class Scheduler(list):
        queued_tokens = 0

    worker = SimpleNamespace(
        s=SimpleNamespace(worker=SimpleNamespace(max_queued_jobs=10, max_queued_tokens=10)), deliverer=None,
        intake=SimpleNamespace(parked=0, parked_tokens=0), scheduler=Scheduler(), _in_engine=[], spool=spool,
        partitions=SimpleNamespace(hold=held.append))
    spool._db.close()  # any count now raises: the loop must not make one
    Worker._backpressure(worker)  # type: ignore[arg-type]
    assert held == ["the spool holds 2 records"]


async def test_records_another_worker_adds_are_counted_by_the_next_flush(tmp_path) -> None:
    """Two workers sharing one spool file: what the other one spools counts toward this one's bound from this one's next
    flusher pass (off the loop), so the bound holds for the file, not for each worker's share of it."""
    spool = Spool(tmp_path / "spool.sqlite", max_records=3)
    d = _deliverer(spool)
    await d.write([_usage(0)])
    other = Spool(tmp_path / "spool.sqlite", max_records=3)
    other.put([_usage(1), _usage(2)])
    other.close()
    await d.flush_once()
    assert spool.known == 3 and spool.full and d.metrics.spool_records._value.get() == 3
    spool.close()
