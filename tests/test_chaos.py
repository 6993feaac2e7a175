"""Chaos: worker processes in one group over the real broker, one SIGKILLed mid-run and restarted, a
third joining to force a rebalance. Every job gets at least one result, every job exactly one ledger
row, and duplicate results carry the same request_id."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from consumer.schemas import Job, Result
from consumer.submit import produce_jobs
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services, read_all, service_settings

pytestmark = pytest.mark.slow

N_JOBS = 450


def _spawn(config_path, worker_id: str, log_dir) -> subprocess.Popen:
    log = open(log_dir / f"{worker_id}.log", "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config_path),
                                 "--worker-id", worker_id], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    finally:
        log.close()


def _jobs() -> list[Job]:
    jobs = []
    for i in range(N_JOBS):
        tenant = ("acme", "globex")[i % 2]
        adapter = None if i % 3 else ("a1" if tenant == "acme" else "g1")
        bad = i % 97 == 0  # answerable but failing: an unknown adapter
        jobs.append(Job(request_id=f"c{i}", tenant_id=tenant, adapter="missing" if bad else adapter,
                        prompt=f"chaos {i}", max_new_tokens=2))
    return jobs


async def _wait_for(settings, predicate, timeout_s: float) -> list[Result]:
    return await read_all(settings, settings.kafka.results_topic, Result, predicate, timeout_s=timeout_s)


async def test_kill_restart_and_rebalance(broker, tmp_path, demo_set, pg_database):
    with fresh_pg_schema(pg_database) as url:
        from billing.db import upgrade
        from migrations import SCRIPT_LOCATION

        upgrade(url, script_location=SCRIPT_LOCATION)
        s = await service_settings(broker, tmp_path, url, demo_set["model"],
                                   **{"kafka.partitions": 6, "worker.commit_interval_ms": 100,
                                      # the defaults: with static members, Tansu's group fell into rebalance storms at 3 s
                                      "kafka.session_timeout_ms": 10_000, "kafka.heartbeat_interval_ms": 3_000})
        svc = open_services(s)
        names = sorted(demo_set["adapters"])
        for tenant, adapter, path in (("acme", "a1", names[0]), ("globex", "g1", names[1])):
            svc.registry.add_tenant(tenant)
            svc.registry.add_adapter(tenant, adapter, demo_set["adapters"][path], default=True)
        config = tmp_path / "worker.toml"
        config.write_text(s.to_toml())
        workers = {w: _spawn(config, w, tmp_path) for w in ("w1", "w2")}
        jobs = _jobs()
        wanted = {j.request_id for j in jobs}
        try:
            await produce_jobs(s.kafka, jobs, "chaos", "acme", "test", "request")
            before_kill = await _wait_for(s, lambda got: len({r.request_id for r in got}) >= N_JOBS // 4, 180)
            assert len({r.request_id for r in before_kill}) < N_JOBS, "the kill must land mid-run"
            workers["w1"].send_signal(signal.SIGKILL)
            workers["w1"].wait()
            await asyncio.sleep(0.5)
            workers["w1"] = _spawn(config, "w1", tmp_path)  # same id: static membership takes its place back
            await _wait_for(s, lambda got: len({r.request_id for r in got}) >= N_JOBS // 2, 180)
            workers["w3"] = _spawn(config, "w3", tmp_path)  # a newcomer forces a rebalance
            # On a loaded machine the rest of the jobs can be done before w3 has built its engine and joined: wait for
            # its assignment either way, so that the drain at the end meets three members of the group.
            joined_by = time.monotonic() + 180
            while "assigned [(" not in (tmp_path / "w3.log").read_text() and time.monotonic() < joined_by:
                await asyncio.sleep(0.5)
            results = await _wait_for(s, lambda got: wanted <= {r.request_id for r in got}, 300)
            # A job whose result the killed w1 published before billing it is run again by its partition's next owner,
            # which bills it then: its result came first, so the run ends once every job is billed too.
            billed_by = time.monotonic() + 120
            while svc.ledger.count_usage() < len(jobs) and time.monotonic() < billed_by:
                await asyncio.sleep(0.5)
        finally:
            for p in workers.values():
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            codes = {}
            for w, p in workers.items():
                try:
                    codes[w] = p.wait(max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes[w] = "killed"
        assigned = (tmp_path / "w3.log").read_text()
        assert "assigned [(" in assigned, "the newcomer must have taken partitions in a rebalance"
        seen = Counter(r.request_id for r in results)
        missing = wanted - seen.keys()
        assert not missing, f"{len(missing)} jobs have no result, e.g. {sorted(missing)[:5]}; logs in {tmp_path}"
        assert set(seen) <= wanted
        for rid, n in seen.items():
            if n > 1:  # a redelivered job: its duplicate results agree on who and what
                copies = [r for r in results if r.request_id == rid]
                assert len({(r.tenant_id, r.status) for r in copies}) == 1
        for j in jobs:
            assert svc.ledger.usage_for(j.tenant_id, j.request_id) is not None, j.request_id
        assert svc.ledger.count_usage() == N_JOBS, "exactly one ledger row per job, whatever the redeliveries"
        assert codes == {"w1": 0, "w2": 0, "w3": 0}, f"SIGTERM drains and exits cleanly; logs in {tmp_path}"
        svc.close()
