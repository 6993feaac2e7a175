"""Fixtures for tests that run the service's real parts: the broker process, the ledger, a worker."""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid
from dataclasses import dataclass

import pytest
from aiokafka import TopicPartition

from consumer.broker import EmbeddedBroker, ensure_topics, free_port
from consumer.config import Settings, load_settings
from consumer.kafka import make_consumer, make_producer
from consumer.schemas import DlqRecord, Result
from consumer.services import Services, open_services
from consumer.worker import Worker


@pytest.fixture(scope="session")
def broker(tmp_path_factory):
    """One Tansu broker process for the session, on a free port; tests use topics of their own."""
    b = EmbeddedBroker(free_port(), log_path=tmp_path_factory.mktemp("broker") / "tansu.log")
    b.start([], 1)
    yield b
    b.stop()


@pytest.fixture(scope="session")
def cpu_engine(demo_set):
    """The tiny model on the CPU, loaded once; adapters are keyed by tenant/name@version."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    return Engine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_new_tokens=32, max_prompt_tokens=200))


async def service_settings(broker: EmbeddedBroker, tmp_path, ledger_url: str, model_dir, **extra) -> Settings:
    run = uuid.uuid4().hex[:8]
    overrides = {
        "kafka.bootstrap_servers": broker.bootstrap,
        "kafka.jobs_topic": f"{run}.jobs",
        "kafka.results_topic": f"{run}.results",
        "kafka.dlq_topic": f"{run}.dlq",
        "kafka.batches_topic": f"{run}.batches",
        "kafka.group_id": f"workers-{run}",
        "kafka.partitions": 3,
        # Tansu answers a JoinGroup after half the session timeout (5 s at the default 10 s, 8 s with static
        # membership): every worker a test starts would wait that long for its partitions.
        "kafka.session_timeout_ms": 3000,
        "kafka.heartbeat_interval_ms": 500,
        "store.adapter_dir": str(tmp_path / "store"),
        "engine.model_dir": str(model_dir),
        "engine.device": "cpu",
        "engine.max_new_tokens": 32,
        "engine.max_prompt_tokens": 200,
        "worker.commit_interval_ms": 50,
        "worker.spool_path": str(tmp_path / f"spool-{run}.sqlite"),
        "ledger.url": ledger_url,
        **extra,
    }
    s = load_settings(None, overrides)
    k = s.kafka
    await ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions)
    return s


@dataclass
class RunningWorker:
    worker: Worker
    task: asyncio.Task

    async def stop(self) -> None:
        self.worker.stop()
        done, _ = await asyncio.wait([self.task], timeout=60)
        if not done:  # say what the stop waits on before cancelling it (a hang seen once in a full run, never alone)
            stacks = io.StringIO()
            for t in asyncio.all_tasks():
                if t is not asyncio.current_task():
                    t.print_stack(limit=12, file=stacks)
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
            raise AssertionError(f"the worker did not stop within 60 s; its tasks:\n{stacks.getvalue()}")
        self.task.result()


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, services: Services, engine):
    w = Worker(settings, engine, services.registry, services.ledger)
    task = asyncio.create_task(w.run())
    rw = RunningWorker(w, task)
    try:
        yield rw
    finally:
        if not task.done():
            await rw.stop()
        else:
            task.result()


async def produce_raw(settings: Settings, values: list[bytes]) -> None:
    p = make_producer(settings.kafka)
    await p.start()
    try:
        for v in values:
            await p.send_and_wait(settings.kafka.jobs_topic, v)
    finally:
        await p.stop()


async def read_all(settings: Settings, topic: str, model, until, timeout_s: float = 120.0) -> list:
    """Every message of a topic parsed with `model`, reading until `until(list)` holds or the time is up."""
    c = make_consumer(settings.kafka, group_id=None)
    await c.start()
    out: list = []
    try:
        tps = [TopicPartition(topic, p) for p in sorted(c.partitions_for_topic(topic) or ())]
        c.assign(tps)
        await c.seek_to_beginning(*tps)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline and not until(out):
            for messages in (await c.getmany(*tps, timeout_ms=200)).values():
                out.extend(model.model_validate_json(m.value) for m in messages)
    finally:
        await c.stop()
    return out


async def ledger_rows(services: Services, at_least: int, timeout_s: float = 30.0) -> int:
    """The ledger's usage row count once it reaches `at_least` (or the time is up). A worker publishes a
    batch's results before it writes their rows, so a reader of the results can be a flush ahead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (n := services.ledger.count_usage()) < at_least and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return n


async def committed_vs_end(settings: Settings) -> tuple[dict, dict]:
    """The group's committed offset and the true log end (last offset + 1) of each jobs partition.

    The log end is found by reading: Tansu's ListOffsets answers the last *batch's* base offset + 1,
    not the last record's, so `end_offsets` undercounts batched topics there.
    """
    k = settings.kafka
    reader = make_consumer(k, group_id=None)
    await reader.start()
    try:
        tps = [TopicPartition(k.jobs_topic, p) for p in sorted(reader.partitions_for_topic(k.jobs_topic) or ())]
        reader.assign(tps)
        await reader.seek_to_beginning(*tps)
        end = {tp.partition: 0 for tp in tps}
        while batches := await reader.getmany(*tps, timeout_ms=500):
            for tp, messages in batches.items():
                end[tp.partition] = messages[-1].offset + 1
    finally:
        await reader.stop()
    group = make_consumer(k, group_id=k.group_id)
    await group.start()
    try:
        committed = {tp.partition: await group.committed(tp) for tp in tps}
    finally:
        await group.stop()
    return committed, end


__all__ = [
    "broker", "cpu_engine", "service_settings", "running_worker", "produce_raw", "read_all", "committed_vs_end",
    "open_services", "Result", "DlqRecord",
]


class RedisServer:
    """A redis-server process of the test's own on a free port, which a test may stop and restart."""

    def __init__(self, tmp_path):
        self.port = free_port()
        self.dir = tmp_path
        self.proc = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import shutil
        import subprocess
        import time

        exe = shutil.which("redis-server")
        assert exe, "redis-server is not installed on this machine"
        self.proc = subprocess.Popen([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.dir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from consumer.broker import port_open

        deadline = time.monotonic() + 10
        while not port_open("127.0.0.1", self.port):
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()
