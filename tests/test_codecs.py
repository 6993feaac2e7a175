"""Every Kafka compression codec in and out; a record batch that cannot be decoded is dead-lettered by offset.

The unit tests walk hand-built record batches through the guarded partition records; the end-to-end test
produces real compressed batches (and a corrupt one) to the embedded broker and runs a worker on them.
"""

from __future__ import annotations

import json
import struct

import aiokafka.codec
import pytest
from aiokafka import TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer import fetcher
from aiokafka.errors import CorruptRecordException, UnsupportedCodecError
from aiokafka.protocol.produce import ProduceRequest
from aiokafka.record._crc32c import crc as crc32c
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from consumer import undecodable
from consumer.config import KafkaConfig
from consumer.kafka import make_producer
from consumer.offsets import OffsetTracker
from consumer.schemas import DlqRecord, Result
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import committed_vs_end, open_services, read_all, running_worker, service_settings

CODECS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
TP = TopicPartition("jobs", 0)


def _batch(values: list[bytes], codec: int = 0, base: int = 0) -> bytearray:
    b = DefaultRecordBatchBuilder(magic=2, compression_type=codec, is_transactional=0, producer_id=-1,
                                  producer_epoch=-1, base_sequence=-1, batch_size=1 << 20)
    for i, v in enumerate(values):
        b.append(i, timestamp=None, key=None, value=v, headers=[])
    buf = b.build()
    struct.pack_into(">q", buf, 0, base)  # the base offset is outside the CRC
    return buf


def _with_codec(buf: bytearray, codec: int) -> bytes:
    """The batch claiming another codec, its CRC recomputed: only the decoder can tell it is wrong."""
    buf[22] = (buf[22] & ~7) | codec
    struct.pack_into(">I", buf, 17, crc32c(bytes(buf[21:])))
    return bytes(buf)


def _corrupt(buf: bytearray) -> bytes:
    buf[-1] ^= 0xFF  # a record byte: the CRC no longer matches
    return bytes(buf)


KEEP = undecodable.KeepValue(1_048_576)  # the deserializer of a consumer with the default fetch size: 16 MiB inflate limit


def _walk(data: bytes, fetch_offset: int = 0, deserializer=KEEP):
    undecodable.install()
    records = fetcher.PartitionRecords(TP, fetcher.MemoryRecords(data), [], fetch_offset, None, deserializer, True, 0)
    out = [(m.offset, undecodable.undecodable(m) or m.value) for m in records]
    return out, records.next_fetch_offset


def test_each_codec_round_trips_through_the_guard():
    """A batch in each codec is handed out record by record, as aiokafka itself would."""
    for name, codec in CODECS.items():
        out, nxt = _walk(bytes(_batch([b"a", b"b", b"c"], codec, base=10)), fetch_offset=10)
        assert out == [(10, b"a"), (11, b"b"), (12, b"c")], name
        assert nxt == 13, name


@pytest.mark.parametrize("bad, error, hint", [
    (lambda: _with_codec(_batch([b"x", b"y"], 0, base=3), 5), "codec 5", "compression.type"),
    (lambda: _with_codec(_batch([b"x", b"y"], 0, base=3), 3), "lz4", "produce these jobs again"),  # no lz4 frame in it
    (lambda: _corrupt(_batch([b"x", b"y"], 1, base=3)), "CRC", "damaged"),
])
def test_an_undecodable_batch_is_one_marker_and_the_rest_is_served(bad, error, hint):
    """good 0..2, bad 3..4, good 5: the bad batch is one marker at 3 covering 3..4, nothing else is lost."""
    data = bytes(_batch([b"a", b"b", b"c"], 1, base=0)) + bad() + bytes(_batch([b"d"], 4, base=5))
    out, nxt = _walk(data)
    assert [o for o, _ in out] == [0, 1, 2, 3, 5] and nxt == 6
    marker = out[3][1]
    assert isinstance(marker, undecodable.Undecodable)
    assert (marker.first, marker.end) == (3, 5)
    text = marker.describe()
    assert "offsets 3..4" in text and hint in text and (error in text or error in marker.codec), text
    assert [v for _, v in out if not isinstance(v, undecodable.Undecodable)] == [b"a", b"b", b"c", b"d"]


def test_a_fetch_starting_inside_a_bad_batch_marks_from_its_own_offset():
    """Resuming at 4 inside a corrupt 3..5 batch: the marker is at 4 (never below the position), up to 6."""
    out, nxt = _walk(_corrupt(_batch([b"x", b"y", b"z"], 0, base=3)) + bytes(_batch([b"d"], 0, base=6)), fetch_offset=4)
    assert [(o, type(v).__name__) for o, v in out] == [(4, "Undecodable"), (6, "bytes")] and nxt == 7
    assert (out[0][1].first, out[0][1].end) == (4, 6)


def test_a_missing_codec_library_is_a_marker_that_names_the_library(monkeypatch):
    data = bytes(_batch([b"a"], CODECS["zstd"], base=0))
    monkeypatch.setattr(aiokafka.codec, "has_zstd", lambda: False)
    out, _ = _walk(data)
    assert "cramjam" in out[0][1].describe() and out[0][1].codec == "zstd"


def test_an_unreadable_batch_header_stops_the_walk_one_offset_on():
    """Garbage where a batch header should be: one marker at the position, the next fetch one offset later."""
    good = bytes(_batch([b"a"], 0, base=0))
    garbage = struct.pack(">qi", 1, 40) + b"\xff" * 40  # a length that holds no valid batch
    out, nxt = _walk(good + garbage)
    assert out[0] == (0, b"a")
    assert len(out) == 2 and isinstance(out[1][1], undecodable.Undecodable) and out[1][0] == 1 and nxt == 2


@pytest.mark.parametrize("codec", ["gzip", "lz4", "zstd"])
def test_a_compression_bomb_is_a_marker_and_never_decompressed_whole(codec, monkeypatch):
    """A batch of a few kilobytes that decompresses past the inflate limit (16x the fetch size: 16 MiB here): one
    marker naming the limit and the fix, the batches around it served. aiokafka used to decompress it whole: 1 GiB
    of zeros is 32 KiB of zstd, and a fetch brings a mebibyte of such batches, so a worker was killed for its memory,
    then again when the record was redelivered to it."""
    bomb = bytes(_batch([b"\0" * (17 << 20)], CODECS[codec], base=1))
    assert len(bomb) < 200_000, len(bomb)
    decoded = []
    real = undecodable._DecodedBatch
    monkeypatch.setattr(undecodable, "_DecodedBatch", lambda batch, records: decoded.append(len(records)) or real(batch, records))
    out, nxt = _walk(bytes(_batch([b"a"], CODECS[codec], base=0)) + bomb + bytes(_batch([b"b"], CODECS[codec], base=2)))
    assert [o for o, _ in out] == [0, 1, 2] and nxt == 3
    assert out[0][1] == b"a" and out[2][1] == b"b"
    marker = out[1][1]
    assert isinstance(marker, undecodable.Undecodable) and (marker.first, marker.end) == (1, 2), marker
    assert f"more than {16 << 20} bytes" in marker.describe() and "kafka.max_message_bytes" in marker.describe(), marker.describe()
    assert decoded == [1, 1], "the bomb's records were decoded"


def test_a_fetch_stops_once_its_batches_decompressed_to_the_limit():
    """Many small batches that each decompress to just under the limit: the fetch hands out what reached the limit and
    leaves the rest to the next fetch (its position at the first batch not handed out), so no fetch holds gigabytes."""
    limit = undecodable.KeepValue(65_536).inflate_limit  # 1 MiB
    batches = [bytes(_batch([bytes([i]) * 600_000], CODECS["zstd"], base=i)) for i in range(5)]
    out, nxt = _walk(b"".join(batches), deserializer=undecodable.KeepValue(65_536))
    assert limit == 1 << 20 and [o for o, _ in out] == [0, 1] and nxt == 2, [o for o, _ in out]
    out, nxt = _walk(b"".join(batches[2:]), fetch_offset=2, deserializer=undecodable.KeepValue(65_536))
    assert [(o, v[:1]) for o, v in out] == [(2, b"\2"), (3, b"\3")] and nxt == 4


def test_other_consumers_keep_aiokafka_behaviour():
    """Only lorabatch's consumers (value deserializer KeepValue) get markers; any other still sees the error."""
    with pytest.raises((CorruptRecordException, UnsupportedCodecError)):
        _walk(_corrupt(_batch([b"x"], 0)), deserializer=None)


def test_a_forged_header_is_not_a_marker():
    """A producer can send a header named like the marker, never an Undecodable object."""
    class M:
        headers = ((undecodable.HEADER, b'{"first": 0, "end": 1000000}'),)
        value = b"{}"
    assert undecodable.undecodable(M()) is None


def test_offsets_commit_past_a_marker_range_and_across_gaps():
    """A marker at 3 standing for 3..4, then 5, then 9 (6..8 never fetched: compacted, a rejected batch)."""
    t = OffsetTracker()
    e = t.fetched(TP, 3, upto=5)
    t.fetched(TP, 5)
    t.fetched(TP, 9)
    t.finished(TP, 5, e)
    assert t.committable() == {}  # 3 still pending: resume there
    t.finished(TP, 3, e)
    assert t.committable() == {TP: 9}
    t.finished(TP, 9, e)
    assert t.committable() == {TP: 10}
    t.mark_committed({TP: 10})
    assert t.fetched(TP, 10) == e, "10 follows the marker's range: the same epoch"


async def test_compression_setting_reaches_the_producer_and_accepts_the_old_name():
    for name in CODECS:
        p = make_producer(KafkaConfig(compression_type=name))
        assert p._compression_type == (None if name == "none" else name)
    assert KafkaConfig.model_validate({"compression": "lz4"}).compression_type == "lz4"
    with pytest.raises(ValueError):
        KafkaConfig(compression_type="brotli")


async def _produce_batch(bootstrap: str, topic: str, data: bytes) -> None:
    """One raw record batch, as a client nobody on the project wrote might send it."""
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.force_metadata_update()
        node = client.cluster.leader_for_partition(TopicPartition(topic, 0))
        response = await client.send(node, ProduceRequest(None, -1, 10_000, [(topic, [(0, data)])]))
        assert response.topics[0][1][0][1] == 0, response
    finally:
        await client.close()


async def _produce_with(s, codec: str, jobs: list[dict]) -> None:
    p = make_producer(s.kafka.model_copy(update={"compression_type": codec}))
    await p.start()
    try:
        for j in jobs:
            await p.send_and_wait(s.kafka.jobs_topic, json.dumps(j).encode(), partition=0)
    finally:
        await p.stop()


def _job(rid: str) -> dict:
    return {"request_id": rid, "tenant_id": "acme", "prompt": f"hello {rid}", "max_new_tokens": 2}


@pytest.mark.slow
@ONE_LEDGER
async def test_worker_serves_every_codec_and_dead_letters_undecodable_batches(broker, tmp_path, demo_set, cpu_engine,
                                                                              ledger_url, monkeypatch):
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"kafka.partitions": 1})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    k = s.kafka
    for codec in CODECS:
        await _produce_with(s, codec, [_job(f"{codec}-1"), _job(f"{codec}-2")])
    corrupt = _corrupt(_batch([json.dumps(_job(f"lost-{i}")).encode() for i in range(3)], CODECS["gzip"]))
    await _produce_batch(k.bootstrap_servers, k.jobs_topic, corrupt)
    await _produce_with(s, "gzip", [_job("after-corrupt")])
    served = {f"{c}-{i}" for c in CODECS for i in (1, 2)} | {"after-corrupt"}

    async with running_worker(s, svc, cpu_engine):
        results = await read_all(s, k.results_topic, Result, lambda got: len(got) >= len(served))
        dlq = await read_all(s, k.dlq_topic, DlqRecord, lambda got: len(got) >= 1)
        committed, end = await _settled(s)
    assert {r.request_id for r in results} == served and all(r.status == "succeeded" for r in results), results
    assert len(dlq) == 1 and dlq[0].error.code == "undecodable_batch", dlq
    assert dlq[0].source_offset == 2 * len(CODECS) and "offsets 10..12" in dlq[0].error.message
    assert "produce these jobs again" in dlq[0].error.message
    assert committed == end, (committed, end)

    # A codec this worker cannot decode (its library "missing"): dead-lettered, the next job served, and the
    # restarted worker starts past the corrupt batch (no second DLQ record for it).
    await _produce_with(s, "lz4", [_job("lz4-unreadable")])
    await _produce_with(s, "gzip", [_job("after-lz4")])
    monkeypatch.setattr(aiokafka.codec, "has_lz4", lambda: False)
    async with running_worker(s, svc, cpu_engine):
        results = await read_all(s, k.results_topic, Result, lambda got: "after-lz4" in {r.request_id for r in got})
        dlq = await read_all(s, k.dlq_topic, DlqRecord, lambda got: len(got) >= 2)
        committed, end = await _settled(s)
    assert "lz4-unreadable" not in {r.request_id for r in results}
    assert [d.error.code for d in dlq] == ["undecodable_batch"] * 2, dlq
    assert "lz4" in dlq[1].error.message and "cramjam" in dlq[1].error.message
    assert committed == end, (committed, end)


async def _settled(s, timeout_s: float = 30.0):
    """The group's committed offsets once they reach the log end (or the last reading at the deadline)."""
    import asyncio

    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        committed, end = await committed_vs_end(s)
        if committed == end or loop.time() > deadline:
            return committed, end
        await asyncio.sleep(0.2)


def test_a_record_aiokafka_steps_over_is_dead_lettered_by_offset():
    """RecordTooLargeError (a record larger than one fetch, on a broker that does not send it whole): aiokafka
    moves one past it and raises once; the worker dead-letters that offset instead of losing it in silence."""
    import asyncio
    from types import SimpleNamespace

    from aiokafka.errors import KafkaConnectionError, RecordTooLargeError

    from consumer.config import Settings
    from consumer.intake import Intake, stepped_over
    from consumer.metrics import WorkerMetrics

    e = RecordTooLargeError("There are some messages at [Partition=Offset]: %s=%s whose size is larger than the "
                            "fetch size %s and hence cannot be ever returned.", TP, 7, 1_048_576)
    assert stepped_over(e) == (TP, 7, 1_048_576)
    assert stepped_over(RecordTooLargeError("no position")) is None and stepped_over(KafkaConnectionError()) is None

    emitted = []
    intake = Intake(Settings(), WorkerMetrics(), "w1", None, None, None, None, asyncio.Event(),
                    SimpleNamespace(rules=[], tenants={}))
    intake.deliverer = SimpleNamespace(emit=emitted.append)
    t = OffsetTracker()
    intake.stepped_over(TP, 7, t.fetched(TP, 7), 1_048_576)
    (o,) = emitted
    assert (o.tp, o.offset, o.result) == (TP, 7, None) and o.dlq.source_offset == 7
    assert o.dlq.error.code == "message_too_large" and "kafka.max_message_bytes" in o.dlq.error.message


@pytest.mark.parametrize("where", ["value", "key", "headers"])
def test_a_record_over_the_limit_by_its_key_or_headers_is_refused_too(where):
    """The worker measures a record as submit measures the message it sends, its key with its value, and its headers
    too: a 1.5 MB key or header beside a small job ran and was billed where the limit is 1 MB."""
    import asyncio
    from types import SimpleNamespace

    from consumer.config import Settings
    from consumer.intake import Intake
    from consumer.metrics import WorkerMetrics
    from consumer.schemas import Rejection

    intake = Intake(Settings(), WorkerMetrics(), "w1", None, None, None, None, asyncio.Event(), SimpleNamespace(rules=[], tenants={}))
    job = b'{"request_id": "big", "tenant_id": "acme", "prompt": "hi"}'
    big = b"x" * 1_500_000
    m = SimpleNamespace(topic="jobs", partition=0, offset=1, value=job + (b" " * len(big) if where == "value" else b""),
                        key=big if where == "key" else b"big", headers=[("h", big)] if where == "headers" else [])  # fmt: skip
    rejected = intake.parse(m)
    assert isinstance(rejected, Rejection) and rejected.error.code == "message_too_large"
    assert "(key, value and headers)" in rejected.error.message
    m.value, m.key, m.headers = job, b"big", [("h", b"small")]
    assert not isinstance(intake.parse(m), Rejection)


@pytest.mark.slow
@ONE_LEDGER
async def test_worker_dead_letters_a_compression_bomb_and_serves_the_next_job(broker, tmp_path, demo_set, cpu_engine, ledger_url):
    """A hostile producer's zstd record of a 32 MiB prompt of one letter (about 1 KB on the wire) under a 16 MiB inflate limit: the
    worker dead-letters its batch by offset, naming the limit and the fix, runs the job behind it, bills only that job
    and commits past both. Before, the worker decompressed every such record whole (a fetch's worth: tens of GiB)."""
    from aiokafka import AIOKafkaProducer

    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"kafka.partitions": 1, "kafka.max_message_bytes": 65_536})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    k = s.kafka
    p = AIOKafkaProducer(bootstrap_servers=k.bootstrap_servers, compression_type="zstd", max_request_size=64 << 20)
    await p.start()
    try:
        bomb = await p.send_and_wait(k.jobs_topic, json.dumps({**_job("bomb"), "prompt": "a" * (32 << 20)}).encode(), partition=0)
        await p.send_and_wait(k.jobs_topic, json.dumps(_job("after-bomb")).encode(), partition=0)
    finally:
        await p.stop()
    async with running_worker(s, svc, cpu_engine):
        results = await read_all(s, k.results_topic, Result, lambda got: "after-bomb" in {r.request_id for r in got})
        dlq = await read_all(s, k.dlq_topic, DlqRecord, lambda got: len(got) >= 1)
        committed, end = await _settled(s)
    assert [(r.request_id, r.status) for r in results] == [("after-bomb", "succeeded")], results
    assert len(dlq) == 1 and dlq[0].error.code == "undecodable_batch" and dlq[0].source_offset == bomb.offset, dlq
    assert f"more than {16 << 20} bytes" in dlq[0].error.message and "kafka.max_message_bytes" in dlq[0].error.message, dlq[0].error
    assert svc.ledger.count_usage() == 1
    assert committed == end, (committed, end)
