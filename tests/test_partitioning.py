"""Correctness does not depend on partitioning: copies of one request on two partitions, read by two workers.

A producer that keys jobs differently from `lorabatch submit` (librdkafka's crc32 default, no key at all)
can put two copies of one (tenant, request_id) on two partitions owned by two workers. Each worker's own
dedupe cannot see the other's copy; what must still hold: every message gets a result naming its
request, the ledger holds exactly one row per request, and that row is one of the answers published.
"""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import pytest
from aiokafka import TopicPartition

from consumer.kafka import make_producer
from consumer.schemas import Result
from tests.db_fixtures import ONE_LEDGER
from tests.service_fixtures import open_services, read_all, running_worker, service_settings

pytestmark = pytest.mark.slow


@ONE_LEDGER
async def test_copies_on_two_partitions_read_by_two_workers_are_billed_once(broker, tmp_path, demo_set, ledger_url):
    from engine.config import EngineConfig
    from engine.engine import Engine

    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"kafka.partitions": 2})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    k = s.kafka
    # One engine per worker: each steps its own in its own thread.
    engines = [Engine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_new_tokens=32, max_prompt_tokens=200))
               for _ in range(2)]
    n = 6
    async with running_worker(s, svc, engines[0]) as w0, running_worker(s, svc, engines[1]) as w1:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while loop.time() < deadline and not (w0.worker.consumer and w1.worker.consumer
                                              and w0.worker.consumer.assignment() and w1.worker.consumer.assignment()):
            await asyncio.sleep(0.2)
        owners = [w.worker.consumer.assignment() for w in (w0, w1)]
        assert all(owners) and not (owners[0] & owners[1]), owners  # each worker owns one partition
        p = make_producer(k)
        await p.start()
        try:
            for i in range(n):
                job = json.dumps({"request_id": f"twice-{i}", "tenant_id": "acme", "prompt": f"story {i} " * 3,
                                  "max_new_tokens": 8, "temperature": 1.0}).encode()
                for partition in (0, 1):  # the same request on both partitions, so on both workers
                    await p.send_and_wait(k.jobs_topic, job, key=b"acme", partition=partition)
        finally:
            await p.stop()
        results = await read_all(s, k.results_topic, Result, lambda got: len(got) >= 2 * n)
        for _ in range(100):  # the ledger rows follow the results within a flush
            if svc.ledger.count_usage() >= n:
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # and a late second row, if one were written, would show by now
        rows = svc.ledger.count_usage()
    by_id: dict[str, list[Result]] = defaultdict(list)
    for r in results:
        by_id[r.request_id].append(r)
    assert sorted(by_id) == sorted(f"twice-{i}" for i in range(n))
    assert all(len(rs) == 2 and all(r.status == "succeeded" for r in rs) for rs in by_id.values()), by_id
    assert rows == n, f"{rows} ledger rows for {n} requests"
    for rid, rs in by_id.items():
        row = svc.ledger.usage_for("acme", rid)
        assert row.status == "succeeded"
        assert (row.input_tokens, row.output_tokens) in {(r.usage.input_tokens, r.usage.output_tokens) for r in rs}
    assert TopicPartition(k.jobs_topic, 0) in owners[0] | owners[1]
    svc.close()
