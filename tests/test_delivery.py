"""Delivery: each result published once whatever fails after it; the ledger's outages spooled, never dropped.

Through the real broker and a real migrated ledger; the ledger's outage is switched on and off around it
(a stopped database is tested end to end in tests/adversarial), and the broker's refusal of one message
by a producer that refuses what it is told to (the embedded broker takes any size the producer sends).
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from billing.errors import LedgerRecordError, LedgerSchemaError, LedgerUnavailableError
from billing.ledger import Ledger
from billing.records import UsageRecord
from consumer.delivery import Deliverer, Outcome
from consumer.kafka import make_producer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import DlqRecord, Result
from consumer.services import open_services
from consumer.spool import Spool
from tests.service_fixtures import read_all, service_settings

NOW = datetime.now(UTC)


class Outage:
    """The real ledger behind a switch: while `error` is set, every write raises it (as the ledger does)."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.error: Exception | None = None
        self.refuse: set[str] = set()  # request ids the ledger refuses as malformed records

    def _guard(self, records):
        if self.error is not None:
            raise self.error
        bad = [r for r in records if getattr(r, "request_id", None) in self.refuse]
        if bad:
            raise LedgerRecordError(f"usage record request_id={bad[0].request_id!r}: refused")

    def record_usage(self, records):
        self._guard(records)
        return self.ledger.record_usage(records)

    def record_busy(self, records):
        self._guard(records)
        return self.ledger.record_busy(records)

    def record_adapter_loads(self, records):
        self._guard(records)
        return self.ledger.record_adapter_loads(records)

    def ping(self):
        self._guard([])
        return self.ledger.ping()


class CountingProducer:
    """The real producer, counting what it sends and refusing chosen sends as the broker would."""

    def __init__(self, producer):
        self.producer = producer
        self.sent: list[tuple[str, bytes]] = []
        self.fail: list[Exception] = []  # raised by the next sends, one each
        self.hang: set[str] = set()  # request ids whose results the broker never acknowledges

    async def send(self, topic, value, key=None):
        if self.fail:
            raise self.fail.pop(0)
        if key is not None and key.decode() in self.hang:  # a broker that took the request and never answers it
            return asyncio.get_running_loop().create_future()
        self.sent.append((topic, value))
        return await self.producer.send(topic, value, key=key)


def _outcome(i: int, text: str = "hello", tenant: str = "acme") -> Outcome:
    rid = f"r{i}"
    result = Result(request_id=rid, tenant_id=tenant, status="succeeded", text=text, finish_reason="length")
    usage = UsageRecord(tenant_id=tenant, request_id=rid, status="succeeded", created_at=NOW, base_us=1000 + i,
                        output_tokens=2)
    return Outcome(TopicPartition("jobs", 0), i, result=result, usage=usage, epoch=1)


@pytest.fixture
async def rig(broker, tmp_path, demo_set, ledger_url):
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"kafka.max_message_bytes": 16_384})
    svc = open_services(s)
    producer = make_producer(s.kafka)
    await producer.start()
    counting = CountingProducer(producer)
    ledger = Outage(svc.ledger)
    offsets = OffsetTracker()
    for i in range(10):
        offsets.fetched(TopicPartition("jobs", 0), i)
    spool = Spool(tmp_path / "spool.sqlite", max_records=1000)
    d = Deliverer(s.kafka, counting, ledger, offsets, WorkerMetrics(), "w1", lambda t: True, spool, flush_s=0.01)
    yield s, svc, d, counting, ledger, offsets, spool
    await producer.stop()
    spool.close()
    svc.close()


def _results(counting) -> list[str]:
    return [v.decode() for t, v in counting.sent if t.endswith(".results")]


@pytest.mark.parametrize("error", [LedgerUnavailableError("down"), LedgerSchemaError("no schema")])
async def test_ledger_outage_spools_and_publishes_once(rig, error):
    """While the ledger cannot take writes, results still go out exactly once, the usage waits in the spool
    (never the DLQ), the offsets are done; when it returns, the flush writes each row once."""
    s, svc, d, counting, ledger, offsets, spool = rig
    ledger.error = error
    for round_ in range(3):
        await d.deliver([_outcome(round_ * 2), _outcome(round_ * 2 + 1)])
    assert len(_results(counting)) == 6 and not [t for t, _ in counting.sent if t.endswith(".dlq")]
    assert len(spool) == 6 and d.ledger_down is not None
    assert d.schema_behind is isinstance(error, LedgerSchemaError)
    assert offsets.committable() == {TopicPartition("jobs", 0): 6}
    assert svc.ledger.count_usage() == 0
    await d.flush_once()  # still down: nothing moves, nothing is lost
    assert len(spool) == 6
    ledger.error = None
    await d.flush_once()
    assert len(spool) == 0 and d.ledger_down is None and not d.schema_behind
    assert svc.ledger.count_usage() == 6
    row = svc.ledger.usage_for("acme", "r3")
    assert row.base_us == 1003 and Result.model_validate_json(row.result_json).text == "hello"
    await d.flush_once()
    assert svc.ledger.count_usage() == 6 and len(_results(counting)) == 6


async def test_another_workers_spool_beside_this_one_is_flushed(rig, tmp_path):
    """A worker killed while the ledger was down and restarted under another --worker-id left its records in its own
    spool file (an operator's drill: 600 requests unbilled for good): the flusher writes the spools beside its own,
    once each however often it runs, and leaves files that are not spools as they are."""
    import sqlite3

    s, svc, d, counting, ledger, offsets, spool = rig
    d.spool.ledger = "postgresql://ledger-a"
    dead = Spool(tmp_path / "w-dead.sqlite", max_records=100, ledger="postgresql://ledger-a")
    dead.put([_outcome(i).usage for i in range(3)])
    dead.close()
    elsewhere = Spool(tmp_path / "w-staging.sqlite", max_records=100, ledger="postgresql://ledger-b")  # another ledger's
    elsewhere.put([_outcome(7).usage])
    elsewhere.close()
    other = sqlite3.connect(tmp_path / "notes.sqlite")
    other.execute("CREATE TABLE notes (x TEXT)")
    other.commit()
    other.close()
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all")
    assert await d.flush_others() == 3
    assert svc.ledger.count_usage() == 3 and svc.ledger.usage_for("acme", "r2").base_us == 1002
    again = Spool(tmp_path / "w-dead.sqlite", max_records=100)
    assert len(again) == 0
    again.close()
    assert await d.flush_others() == 0 and svc.ledger.count_usage() == 3
    tables = {r[0] for r in sqlite3.connect(tmp_path / "notes.sqlite").execute("SELECT name FROM sqlite_master")}
    assert tables == {"notes"}, "a database that is not a spool is not touched"
    assert (tmp_path / "junk.sqlite").read_bytes() == b"not a database at all"
    staging = Spool(tmp_path / "w-staging.sqlite", max_records=100)
    assert len(staging) == 1, "records for another ledger stay where they are"
    staging.close()


async def test_a_refused_record_goes_to_the_dlq_and_the_rest_are_written(rig):
    """One malformed record does not hold its batch: it is dead-lettered with the reason, the others land."""
    s, svc, d, counting, ledger, offsets, spool = rig
    ledger.refuse = {"r1"}
    await d.deliver([_outcome(0), _outcome(1), _outcome(2)])
    assert svc.ledger.count_usage() == 2 and len(spool) == 0
    dlq = await read_all(s, s.kafka.dlq_topic, DlqRecord, lambda got: len(got) >= 1)
    assert [(r.error.code, r.request_id) for r in dlq] == [("ledger_rejected", "r1")]


async def test_oversized_result_is_answered_small_and_dead_lettered(rig):
    """A result over kafka.max_message_bytes goes out as a small failed result naming the limit; its body goes
    to the DLQ cut to size; the row keeps the GPU time that was spent, with the status the tenant saw."""
    s, svc, d, counting, ledger, offsets, spool = rig
    await d.deliver([_outcome(0, text="x" * 50_000), _outcome(1)])
    results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= 2)
    big = next(r for r in results if r.request_id == "r0")
    assert big.status == "failed" and big.error.code == "result_too_large" and "max_message_bytes" in big.error.message
    assert big.finish_reason is None and big.text == "", "a failed result has no finish reason (the contract)"
    dlq = await read_all(s, s.kafka.dlq_topic, DlqRecord, lambda got: len(got) >= 1)
    assert dlq[0].error.code == "result_too_large" and dlq[0].raw_bytes > 50_000 and dlq[0].raw_truncated
    row = svc.ledger.usage_for("acme", "r0")
    assert row.status == "failed" and row.error_code == "result_too_large" and row.base_us == 1000


async def test_broker_refusals_are_bounded_and_retries_send_each_part_once(rig):
    """A retriable broker error is waited out and each message is sent once in the end; a message the broker
    refuses outright is replaced by its small failed form, and a refused small form is dropped loudly:
    no retry loop is unbounded."""
    s, svc, d, counting, ledger, offsets, spool = rig
    counting.fail = [KafkaConnectionError("broker away"), KafkaConnectionError("still away")]
    await d.deliver([_outcome(0)])
    assert len(_results(counting)) == 1
    counting.fail = [MessageSizeTooLargeError("no")]
    await d.deliver([_outcome(1)])
    assert [r for r in _results(counting) if '"r1"' in r and "result_undeliverable" in r]
    counting.fail = [MessageSizeTooLargeError("no"), MessageSizeTooLargeError("not even small")]
    await asyncio.wait_for(d.deliver([_outcome(2)]), 10)
    assert d.metrics.undeliverable._value.get() == 1
    assert offsets.committable() == {TopicPartition("jobs", 0): 3}
    assert svc.ledger.count_usage() == 3


async def test_a_wait_for_the_broker_names_the_topic_it_waits_on(rig, caplog):
    """The line a publish wait logs names the topic the outcomes go to: on a cluster with topic auto-creation off, a
    results topic nobody made is a wait that never ends (UnknownTopicOrPartition, retriable), and the line said only
    how many outcomes waited."""
    from aiokafka.errors import UnknownTopicOrPartitionError

    s, svc, d, counting, ledger, offsets, spool = rig
    counting.fail = [UnknownTopicOrPartitionError("no such topic")]
    with caplog.at_level("WARNING", logger="lorabatch.worker"):
        await d.deliver([_outcome(0)])
    waits = [r.getMessage() for r in caplog.records if "waiting for the broker to publish" in r.getMessage()]
    assert waits and s.kafka.results_topic in waits[0], waits
    assert len(_results(counting)) == 1


async def test_stopping_with_neither_ledger_nor_spool_gives_up_leaving_offsets_uncommitted(rig, monkeypatch):
    """The ledger away and the spool's disk full: while serving, the deliverer waits for space (nothing else can be
    done); once the worker stops, it gives up at the first failed write instead of outlasting every stop deadline
    (SIGTERM ignored for minutes). The outcomes it could not bill stay in the outbox, their offsets unfinished, so
    their jobs are redelivered to the next owner; none is dead-lettered, and drain() returns."""
    import asyncio
    import sqlite3

    from consumer.delivery import SpoolUnavailable

    s, svc, d, counting, ledger, offsets, spool = rig
    ledger.error = LedgerUnavailableError("down")

    def full(records):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(spool, "put", full)
    d.stopping = True
    with pytest.raises(SpoolUnavailable, match="disk is full"):
        await d.write([_outcome(0).usage])
    runner = asyncio.create_task(d.run())
    d.emit(_outcome(1))
    d.emit(_outcome(2))
    await asyncio.wait_for(d.drain(), timeout=10)
    await asyncio.wait_for(runner, timeout=10)  # run() ended: nothing more can be delivered
    assert d.gave_up and len(d.outbox) == 2
    assert offsets.committable() == {} and not [t for t, _ in counting.sent if t.endswith(".dlq")]


async def test_with_neither_the_ledger_nor_the_spool_taking_records_the_gauges_and_one_line_say_so(rig, monkeypatch, caplog):
    """The ledger down and the spool's disk full: `lorabatch_ledger_up` stays 0 (the flusher, finding the spool empty,
    set it to 1 at each pass: 99 of 100 samples of a drill read 1), `lorabatch_spool_up` is 0, and one log line says
    so however many writes wait. The ledger back while the disk stays full takes the waiting records, once each; the
    spool is said writable once its disk has space again, with no record to prove it."""
    import logging
    import sqlite3

    s, svc, d, counting, ledger, offsets, spool = rig
    ledger.error = LedgerUnavailableError("down")
    disk = {"full": True}
    put, probe = spool.put, spool.probe

    def full(real):
        def call(*args):
            if disk["full"]:
                raise sqlite3.OperationalError("database or disk is full")
            return real(*args)
        return call

    monkeypatch.setattr(spool, "put", full(put))
    monkeypatch.setattr(spool, "probe", full(probe))
    gauge = d.metrics.registry.get_sample_value
    runner = asyncio.create_task(d.run())
    with caplog.at_level(logging.INFO, "lorabatch.worker"):
        busy = asyncio.create_task(d.write([_outcome(9).usage]))  # a second writer, as the GPU-time records are
        for i in range(4):
            d.emit(_outcome(i))
            await asyncio.sleep(0.1)
            await d.flush_once()
            assert (gauge("lorabatch_ledger_up"), gauge("lorabatch_spool_up")) == (0, 0)
        assert gauge("lorabatch_waiting", {"on": "spool"}) == 1 and offsets.committable() == {}
        said = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
        assert len(said) == 1 and "can be neither written nor kept" in said[0], said
        ledger.error = None  # back, the disk still full
        await asyncio.wait_for(asyncio.gather(d.drain(), busy), 20)
        assert svc.ledger.count_usage() == 5 and len(spool) == 0
        assert offsets.committable() == {TopicPartition("jobs", 0): 4}
        assert gauge("lorabatch_ledger_up") == 1 and gauge("lorabatch_waiting", {"on": "spool"}) == 0
        await d.flush_once()
        assert gauge("lorabatch_spool_up") == 0, "its disk is still full"
        disk["full"] = False
        await d.flush_once()
        assert gauge("lorabatch_spool_up") == 1
    assert sum(r.getMessage().startswith("the spool at") and "takes writes again" in r.getMessage() for r in caplog.records) == 1
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)


def _killed_workers(folder, ledger: str, files: dict[str, list[int]]) -> None:
    """Workers killed while the ledger was down (os._exit, nothing closed): `files` names each one's spool and the
    request numbers it holds; their WAL, shared-memory and lock files stay behind, as a kill leaves them."""
    import json
    import subprocess
    import sys

    script = (
        "import json, os, sys\n"
        "from tests.test_delivery import _outcome\n"
        "from consumer.spool import Spool\n"
        "folder, ledger, files = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])\n"
        "spools = [Spool(f'{folder}/{name}.sqlite', 1000, ledger=ledger) for name in files]\n"
        "for s, numbers in zip(spools, files.values()):\n"
        "    s.put([_outcome(i).usage for i in numbers])\n"
        "os._exit(0)\n")
    subprocess.run([sys.executable, "-c", script, str(folder), ledger, json.dumps(files)], check=True, timeout=60)


async def test_spool_files_of_workers_that_are_gone_are_deleted_once_their_records_are_in_the_ledger(rig, tmp_path):
    """Many short-lived workers (killed while the ledger was down, or never spooling at all) left a file each that
    nothing deleted: 30 of them (and their WAL, shared-memory files) stayed after every record was in the ledger, each
    opened again every minute. Their records are written once each (two files holding one request bill it once), then
    the files go; a worker still running keeps its file, which it flushes itself, until it is gone too."""
    s, svc, d, counting, ledger, offsets, spool = rig
    d.spool.ledger = "postgresql://ledger-a"
    files = {f"w-{n}": [n % 10, 10 + n] for n in range(20)} | {f"idle-{n}": [] for n in range(10)}
    _killed_workers(tmp_path, "postgresql://ledger-a", files)
    assert (tmp_path / "w-0.sqlite-wal").exists(), "a kill leaves the WAL file"
    alive = Spool(tmp_path / "w-alive.sqlite", max_records=100, ledger="postgresql://ledger-a")
    alive.put([_outcome(99).usage])
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all")
    assert await d.flush_others() == 40
    assert svc.ledger.count_usage() == 30, "r0..r9 were in two files each: one row each"
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("w-", "idle-")))
    assert left == ["w-alive.sqlite", "w-alive.sqlite-shm", "w-alive.sqlite-wal", "w-alive.sqlite.lock"], left
    assert (tmp_path / "junk.sqlite").read_bytes() == b"not a database at all"
    assert not (tmp_path / "junk.sqlite.lock").exists(), "nothing is made beside a file that is not a spool"
    alive.close()  # that worker is gone too
    assert await d.flush_others() == 1 and svc.ledger.count_usage() == 31
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(("w-", "idle-"))]


async def test_two_workers_sharing_the_folder_flush_the_gone_ones_files_at_once_and_bill_each_record_once(rig, tmp_path):
    """Two workers beside each other both sweeping the folder at the same moment: every record of the workers that are
    gone lands once, every such file is deleted, and neither worker's own file is touched."""
    s, svc, d, counting, ledger, offsets, spool = rig
    d.spool.ledger = "postgresql://ledger-a"
    _killed_workers(tmp_path, "postgresql://ledger-a", {f"w-{n}": list(range(n * 40, n * 40 + 40)) for n in range(8)})
    other_spool = Spool(tmp_path / "w-other.sqlite", max_records=1000, ledger="postgresql://ledger-a")
    other = Deliverer(s.kafka, counting, ledger, OffsetTracker(), WorkerMetrics(), "w2", lambda t: True, other_spool)
    moved = await asyncio.gather(d.flush_others(chunk=7), other.flush_others(chunk=7))
    for _ in range(3):  # a file (or lock file) the other had open at a pass is left for the next
        names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("w-"))
        if len(names) == 4:
            break
        moved += await asyncio.gather(d.flush_others(), other.flush_others())
    assert svc.ledger.count_usage() == 320 and sum(moved) >= 320
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("w-"))
    assert names == ["w-other.sqlite", "w-other.sqlite-shm", "w-other.sqlite-wal", "w-other.sqlite.lock"], names
    assert (tmp_path / "spool.sqlite").exists()
    other_spool.close()


async def test_a_stop_that_gives_up_on_a_broker_frozen_mid_batch_bills_what_it_took(rig):
    """The broker acknowledges r0's result and then stops answering (frozen) before r1's: the batch is never billed
    whole. At the stop, once the drain gives up and the run task is ended, r0 (published, counted as published) is
    billed and done; r1 stays unbilled and uncommitted for the next owner. Before, r0 had a result and no row."""
    s, svc, d, counting, ledger, offsets, spool = rig
    counting.hang = {"r1"}
    run = asyncio.create_task(d.run())
    d.emit(_outcome(0))
    d.emit(_outcome(1))
    for _ in range(500):
        if d.published == 1:
            break
        await asyncio.sleep(0.01)
    assert d.published == 1 and svc.ledger.count_usage() == 0
    assert not await d.drain(stall_s=0.2)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert await d.bill_published() == 1
    assert svc.ledger.count_usage() == 1 and svc.ledger.usage_for("acme", "r0") is not None
    assert offsets.committable() == {TopicPartition("jobs", 0): 1}
    assert [o.request_id for o in [x.result for x in d.outbox]] == ["r1"]
    assert await d.bill_published() == 0 and svc.ledger.count_usage() == 1


async def test_a_stop_that_bills_what_the_frozen_broker_took_leaves_a_reread_of_an_unpublished_answer(rig):
    """An outcome with nothing to send stands for an answer published elsewhere (a message read again after the
    partition's position went back: the intake emits it with no result, under the new epoch, which alone can commit
    the offset). The broker froze before it took that answer: the stop bills what the broker took and leaves the
    re-read uncommitted too, or the commit would pass an answer that was neither published nor billed."""
    s, svc, d, counting, ledger, offsets, spool = rig
    tp = TopicPartition("jobs", 0)
    counting.hang = {"r0"}
    run = asyncio.create_task(d.run())
    d.emit(_outcome(0))  # epoch 1; never acknowledged
    epoch = offsets.fetched(tp, 0)  # read again from offset 0: a new epoch, in which offsets 0..9 are pending again
    for i in range(1, 10):
        offsets.fetched(tp, i, None)
    d.emit(Outcome(tp, 0, epoch=epoch))  # the re-read of r0's message: answered already, so nothing to send
    assert not await d.drain(stall_s=0.2)
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    assert await d.bill_published() == 0
    assert offsets.committable().get(tp, 0) == 0, "committed past r0, whose answer was neither published nor billed"
    assert svc.ledger.count_usage() == 0 and len(d.outbox) == 2


async def test_billing_what_a_frozen_broker_took_is_bounded_in_time(rig, monkeypatch, caplog):
    """bill_published writes within its bound: a record the ledger refuses is dead-lettered through the broker that is
    away, which waits for ever. Past the bound nothing is marked done (the jobs stay for the next owner) and a line says
    so; a write that ran on adds no second row when they are billed again (the ledger keeps one a request)."""
    s, svc, d, counting, ledger, offsets, spool = rig
    o = _outcome(0)
    o.sent.add("result")
    d.outbox.append(o)

    async def never(records):
        await asyncio.Event().wait()

    monkeypatch.setattr(d, "write", never)
    assert await d.bill_published(within_s=0.1) == 0
    assert offsets.committable() == {} and d.outbox == [o]
    assert "not written within 0.1 s" in caplog.text


async def test_an_outcome_that_cannot_be_delivered_is_dead_lettered_with_its_identity(rig):
    """An outcome our code cannot deliver (here a result whose text holds a lone surrogate, which no JSON encoder
    writes) is replaced by a DLQ record; that record named no request, tenant or batch, so `lorabatch results` could not
    account for the job and waited out its --timeout, then asked whether a worker was running."""
    s, svc, d, counting, ledger, offsets, spool = rig
    bad = _outcome(0, text="x\ud800")
    bad.result = bad.result.model_copy(update={"batch_id": "b1"})
    await d._deliver_alone(bad)
    dlq = await read_all(s, s.kafka.dlq_topic, DlqRecord, lambda got: len(got) >= 1)
    assert [(r.error.code, r.tenant_id, r.batch_id, r.request_id) for r in dlq] == [("undeliverable", "acme", "b1", "r0")]
