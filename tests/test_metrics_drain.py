"""The worker's gauges tell the truth while it stops: a drain's progress shows on /metrics, and ends at nothing in flight."""

from __future__ import annotations

import asyncio

import pytest

from consumer.metrics import WorkerMetrics
from consumer.schemas import Job
from consumer.submit import produce_jobs
from tests.service_fixtures import open_services, running_worker, service_settings

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)],
                                                        indirect=True)]


def _value(metrics: WorkerMetrics, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == name)


async def test_gauges_follow_the_drain_to_zero(broker, tmp_path, demo_set, cpu_engine, ledger_url):
    """lorabatch_in_flight and lorabatch_queue_depth were refreshed by the fetch loop only, which ends at the stop: through
    a 15 s drain they stayed at their value at the stop (176 in flight, 160 queued) while 88 jobs finished, and never
    came down to 0. They now move during the drain and read 0 once it has finished every job."""
    s = await service_settings(broker, tmp_path, ledger_url, demo_set["model"], **{"worker.stop_deadline_s": 120.0})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    jobs = [Job.model_validate({"request_id": f"r{i}", "tenant_id": "acme", "prompt": f"tell me about {i}",
                                "max_new_tokens": 32}) for i in range(96)]
    async with running_worker(s, svc, cpu_engine) as rw:
        m = rw.worker.metrics
        while not m.health.ready()[0]:  # /readyz: serving once connected with its engine running
            assert not rw.task.done() and m.health.phase in ("connecting", "starting"), m.health.ready()
            await asyncio.sleep(0.01)
        assert m.health.ready()[1] == {"ready": True, "phase": "serving", "engine": True, "degraded": []}
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not (_value(m, "lora_request_total") >= 1 and _value(m, "lorabatch_in_flight") > 0) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        rw.worker.stop()
        assert m.health.ready()[1]["reasons"] == ["the worker is stopping"]  # a drain takes no new work
        at_stop = _value(m, "lorabatch_in_flight")
        assert at_stop > 0, "the stop came after every job was done: nothing to drain"
        seen = {at_stop}
        while not rw.task.done():
            seen.add(_value(m, "lorabatch_in_flight"))
            await asyncio.sleep(0.02)
        await rw.stop()
        assert _value(m, "lora_request_total") == len(jobs), "the drain finished every job"
        # A batch of 32 finished and committed leaves at most 64 of the 95 or so: the gauge passes half of its value at the stop.
        assert min(seen) <= at_stop / 2, f"lorabatch_in_flight stayed at {sorted(seen)} through a drain from {at_stop}"
        assert _value(m, "lorabatch_in_flight") == 0
        assert _value(m, "lorabatch_queue_depth") == 0
    svc.close()
