"""librdkafka (confluent-kafka), the client most non-Python services use, against the embedded broker.

Jobs produced by it at its defaults, with each compression codec and with idempotence are served; its
consumer reads the workers' results; `lorabatch results` collects a batch that it produced, with no
manifest; and its `murmur2_random` partitioner puts a key where `lorabatch submit` (murmur2) does.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aiokafka.partitioner import DefaultPartitioner

confluent_kafka = pytest.importorskip("confluent_kafka")

from consumer.broker import EmbeddedBroker, free_port  # noqa: E402
from consumer.schemas import Result  # noqa: E402
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import open_services, running_worker, service_settings  # noqa: E402

CODECS = ("gzip", "snappy", "lz4", "zstd")


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes]], **conf) -> list[tuple[int, int]]:
    """Produce with librdkafka; the (partition, offset) of each record, in order. Any delivery error fails."""
    p = confluent_kafka.Producer({"bootstrap.servers": bootstrap, **conf})
    placed: dict[int, tuple[int, int]] = {}
    errors = []

    def report(i):
        def done(err, msg):
            if err is not None:
                errors.append(err)
            else:
                placed[i] = (msg.partition(), msg.offset())
        return done

    for i, (key, value) in enumerate(records):
        p.produce(topic, value, key=key, on_delivery=report(i))
    assert p.flush(30) == 0, "librdkafka did not deliver everything within 30 s"
    assert not errors, errors
    return [placed[i] for i in range(len(records))]


def _consume(bootstrap: str, topic: str, partitions: int, until, timeout_s: float = 60.0) -> list:
    """Read a topic from the beginning with librdkafka (assigned partitions, no group join)."""
    c = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": "rdk-readers", "enable.auto.commit": False})
    c.assign([confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in range(partitions)])
    out = []
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and not until(out):
            m = c.poll(0.2)
            if m is None:
                continue
            assert m.error() is None, m.error()
            out.append(m.value())
    finally:
        c.close()
    return out


def _job(rid: str, batch: str = "rdk-b1") -> bytes:
    return json.dumps({"request_id": rid, "tenant_id": "acme", "batch_id": batch, "prompt": f"hi {rid}",
                       "max_new_tokens": 2}).encode()


@pytest.mark.slow
@ONE_LEDGER
async def test_librdkafka_jobs_are_served_and_results_collect_without_a_manifest(broker, tmp_path, demo_set, cpu_engine, ledger_url):
    from typer.testing import CliRunner

    from consumer.cli import build_app

    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"])
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    k = s.kafka
    sent = {}
    sent["defaults"] = [f"d{i}" for i in range(3)]
    await asyncio.to_thread(_produce, k.bootstrap_servers, k.jobs_topic, [(b"acme", _job(r)) for r in sent["defaults"]])
    for codec in CODECS:
        sent[codec] = [f"{codec}{i}" for i in range(2)]
        await asyncio.to_thread(_produce, k.bootstrap_servers, k.jobs_topic, [(b"acme", _job(r)) for r in sent[codec]],
                                **{"compression.type": codec, "linger.ms": 50})  # both in one compressed batch
    sent["idempotent"] = ["idem0", "idem1"]
    placed = await asyncio.to_thread(_produce, k.bootstrap_servers, k.jobs_topic, [(b"acme", _job(r)) for r in sent["idempotent"]],
                                     **{"enable.idempotence": True})
    assert len(set(placed)) == 2, placed  # each record once: this broker answers InitProducerId
    await asyncio.to_thread(_produce, k.bootstrap_servers, k.jobs_topic, [(b"acme", _job("other-batch", "rdk-b2"))])
    wanted = [r for ids in sent.values() for r in ids]
    config = tmp_path / "lorabatch.toml"
    config.write_text(s.to_toml())

    async with running_worker(s, svc, cpu_engine):
        # librdkafka's consumer reads what the workers (aiokafka, gzip) published.
        values = await asyncio.to_thread(_consume, k.bootstrap_servers, k.results_topic, k.partitions,
                                         lambda got: len(got) >= len(wanted) + 1)
        results = {r.request_id: r for r in map(Result.model_validate_json, values)}
        assert set(results) == set(wanted) | {"other-batch"}
        assert all(r.status == "succeeded" and r.batch_id in ("rdk-b1", "rdk-b2") for r in results.values()), results

        # No manifest was written: `results` finds the batch's jobs in the jobs topic, and only this batch's.
        out = await asyncio.to_thread(CliRunner().invoke, build_app(),
                                      ["results", "--batch-id", "rdk-b1", "--tenant", "acme", "--timeout", "60",
                                       "--config", str(config)])
        assert out.exit_code == 0, out.output
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert [line["request_id"] for line in lines] == wanted  # in the order the jobs topic holds them
        assert all(line["status"] == "succeeded" and line["batch_id"] == "rdk-b1" for line in lines)

        out = await asyncio.to_thread(CliRunner().invoke, build_app(),
                                      ["results", "--batch-id", "rdk-nope", "--tenant", "acme", "--timeout", "5",
                                       "--config", str(config)])
        assert out.exit_code == 2 and "no job in" in out.output and "rdk-nope" in out.output, out.output
        out = await asyncio.to_thread(CliRunner().invoke, build_app(),
                                      ["results", "--batch-id", "rdk-b1", "--tenant", "globex", "--timeout", "5",
                                       "--config", str(config)])
        assert out.exit_code == 2, out.output  # another tenant's batch of that id is not this one
    svc.close()


def test_murmur2_random_places_keys_as_lorabatch_submit_does(tmp_path):
    """The partitioning contract: librdkafka with partitioner=murmur2_random puts each key on the partition
    aiokafka's default (murmur2, `lorabatch submit`) picks; librdkafka's default (crc32) does not."""
    partitions = 8
    b = EmbeddedBroker(free_port(), log_path=tmp_path / "tansu.log")
    b.start(["placed"], partitions)
    try:
        keys = [f"tenant-{i}".encode() for i in range(24)]
        murmur = DefaultPartitioner()
        expected = [murmur(k, list(range(partitions)), list(range(partitions))) for k in keys]
        placed = _produce(b.bootstrap, "placed", [(k, b"x") for k in keys], partitioner="murmur2_random")
        assert [p for p, _ in placed] == expected
        default = _produce(b.bootstrap, "placed", [(k, b"x") for k in keys])
        assert [p for p, _ in default] != expected, "librdkafka's default partitioner is crc32 (consistent_random)"
    finally:
        b.stop()
