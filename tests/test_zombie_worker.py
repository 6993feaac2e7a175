"""A worker frozen past its Kafka session (SIGSTOP, then SIGCONT): the group gives its partitions to the other worker,
which runs the uncommitted jobs again; the frozen one, on waking, finds it lost them, commits nothing for them, says so
in one line, and goes on. Real broker, real PostgreSQL ledger, workers as processes."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from types import SimpleNamespace
from datetime import UTC, datetime, timedelta

import pytest

from consumer.broker import free_port
from consumer.schemas import Job, Result
from consumer.submit import produce_jobs
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import committed_vs_end, open_services, read_all, service_settings


N_JOBS = 80
SESSION_MS = 6_000


def _spawn(config_path, log_path) -> subprocess.Popen:
    # No --worker-id: dynamic members, which the broker drops once their session times out.
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config_path)],
                                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _get(port: int, path: str) -> tuple[int, dict | str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            body = r.read().decode()
            return r.status, json.loads(body) if path != "/metrics" else body
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _gauge(port: int, name: str) -> float:
    _, text = _get(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _until(what, predicate, timeout_s: float, log_dir) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s; logs in {log_dir}"
        await asyncio.sleep(0.1)


def _assignments(log_path) -> list[str]:
    return [line for line in log_path.read_text().splitlines() if "assigned [" in line]


@pytest.mark.slow
@pytest.mark.postgres
async def test_a_worker_frozen_past_its_session_loses_its_partitions_cleanly(broker, tmp_path, demo_set, pg_database):
    """Invariants: one usage row per job; duplicate results agree on who, what and the text; the woken worker commits no
    offset of a partition it lost (the group's offsets end at the log's end, nothing skipped) and says so in one line;
    the GPU time it spent on the jobs it abandoned is unbilled work, nothing unexplained; its /readyz answers after the
    wake; both workers drain and exit 0 on SIGTERM."""
    with fresh_pg_schema(pg_database) as url:
        from billing.db import upgrade
        from migrations import SCRIPT_LOCATION

        upgrade(url, script_location=SCRIPT_LOCATION)
        s = await service_settings(broker, tmp_path, url, demo_set["model"],
                                   **{"kafka.partitions": 4, "kafka.session_timeout_ms": SESSION_MS,
                                      "kafka.heartbeat_interval_ms": 1_000, "worker.commit_interval_ms": 100,
                                      "worker.revoke_deadline_s": 2.0, "worker.ledger_flush_ms": 200})
        svc = open_services(s)
        names = sorted(demo_set["adapters"])
        for tenant, adapter, path in (("acme", "a1", names[0]), ("globex", "g1", names[1])):
            svc.registry.add_tenant(tenant)
            svc.registry.add_adapter(tenant, adapter, demo_set["adapters"][path], default=True)
        port = free_port()
        config_a, config_b = tmp_path / "a.toml", tmp_path / "b.toml"
        config_a.write_text(s.model_copy(update={"worker": s.worker.model_copy(update={"metrics_port": port})}).to_toml())
        config_b.write_text(s.to_toml())
        log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
        a = _spawn(config_a, log_a)
        procs = [a]
        jobs = [Job(request_id=f"z{i}", tenant_id=("acme", "globex")[i % 2], prompt=f"zombie {i}",
                    max_new_tokens=6) for i in range(N_JOBS)]
        wanted = {j.request_id for j in jobs}
        ready_seen: list[tuple[str, int, dict]] = []
        try:
            await _until("worker A assigned", lambda: _assignments(log_a), 90, tmp_path)
            procs.append(b := _spawn(config_b, log_b))
            await _until("worker B assigned", lambda: any("assigned [(" in x for x in _assignments(log_b)), 90, tmp_path)
            await _until("worker A reassigned", lambda: len(_assignments(log_a)) >= 2, 60, tmp_path)
            assert _get(port, "/readyz")[0] == 200
            await produce_jobs(s.kafka, jobs, "zombie", "acme", "test", "request")
            await _until("worker A has jobs in flight", lambda: _gauge(port, "lorabatch_in_flight") >= 4, 60, tmp_path)
            b_assigned = len(_assignments(log_b))
            a.send_signal(signal.SIGSTOP)
            frozen_at = time.monotonic()
            # B takes every partition once A's session has timed out.
            await _until("B takes A's partitions", lambda: len(_assignments(log_b)) > b_assigned
                         and _assignments(log_b)[-1].count("(") == 4, 40, tmp_path)
            frozen_for = time.monotonic() - frozen_at
            a.send_signal(signal.SIGCONT)
            # During and after the wake: /readyz answers, whatever it says.
            for _ in range(30):
                code, body = _get(port, "/readyz")
                ready_seen.append(("after", code, body))
                await asyncio.sleep(0.2)
            results = await read_all(s, s.kafka.results_topic, Result, lambda got: wanted <= {r.request_id for r in got}, 120)
            deadline = time.monotonic() + 60
            while svc.ledger.count_usage() < N_JOBS and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            # A rejoins the group and serves again.
            await _until("A rejoins and is ready", lambda: _get(port, "/readyz")[0] == 200, 60, tmp_path)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(signal.SIGTERM)
            codes = []
            for p in procs:
                try:
                    codes.append(p.wait(60))
                except subprocess.TimeoutExpired:
                    p.kill()
                    codes.append("killed")
        text_a = log_a.read_text()
        assert frozen_for > SESSION_MS / 1000
        assert codes == [0, 0], f"both drain and exit 0 on SIGTERM: {codes}; logs in {tmp_path}"
        copies: dict[str, list[Result]] = defaultdict(list)
        for r in results:
            copies[r.request_id].append(r)
        missing = wanted - copies.keys()
        assert not missing, f"{len(missing)} jobs have no result, e.g. {sorted(missing)[:5]}; logs in {tmp_path}"
        for rid, rs in copies.items():
            assert len({(r.tenant_id, r.status, r.text, r.finish_reason) for r in rs}) == 1, (rid, rs)
        for j in jobs:
            assert svc.ledger.usage_for(j.tenant_id, j.request_id) is not None, j.request_id
        assert svc.ledger.count_usage() == N_JOBS, "one usage row per job, whoever ran it"
        committed, end = await committed_vs_end(s)
        assert committed == end, f"the group's offsets end where the log does: {committed} vs {end}; logs in {tmp_path}"
        lost = [line for line in text_a.splitlines() if "lost" in line and "partition" in line]
        assert len(lost) == 1, f"one line says the frozen worker lost its partitions: {lost}; logs in {tmp_path}"
        assert "Traceback" not in text_a, f"logs in {tmp_path}"
        woke = [line for line in text_a.splitlines() if "member_id was not recognized" in line]
        assert woke, f"A learnt on its next heartbeat that the group dropped it; logs in {tmp_path}"
        # Answered at every probe after the wake, the worker serving (while it rejoins, 200 today); ready again after.
        assert all(c in (200, 503) and body["phase"] == "serving" for _, c, body in ready_seen), ready_seen
        # A's abandoned engine time is named unbilled work; B bills the jobs; nothing is left unexplained.
        from billing.config import LedgerConfig
        from billing.db import make_engine
        from billing.reconcile import reconcile_report

        period = svc.ledger.usage_for(jobs[0].tenant_id, jobs[0].request_id).period
        db = make_engine(url)
        try:
            report = reconcile_report(db, period, LedgerConfig(url=url), now=datetime.now(UTC) + timedelta(days=40))
        finally:
            db.dispose()
        lines = {line.item: line.us for line in report.lines}
        assert lines["unbilled_work"] > 0 and lines["unexplained_busy"] == 0, lines
        svc.close()


class _DroppedMember:
    """A consumer the group dropped: aiokafka reset its generation; a commit is recorded (the broker would refuse it)."""

    def __init__(self, generation: int):
        self._coordinator = SimpleNamespace(generation=generation)
        self.commits: list[dict] = []

    async def commit(self, offsets):
        self.commits.append(dict(offsets))


class _Engine:
    def __init__(self):
        self.aborted: list[tuple[str, str]] = []

    async def abort(self, request_id, tenant_id=""):
        self.aborted.append((tenant_id, request_id))


async def test_lost_partitions_are_abandoned_at_once_and_not_committed(tmp_path, caplog):
    """A revoke after the group dropped the worker (generation reset) aborts what runs without waiting for
    worker.revoke_deadline_s (here an hour: the job never finishes), commits nothing, forgets the partitions and says so
    in one line; `membership_lost` is false for a member in good standing (generation 0 on Tansu's first join)."""
    from aiokafka import TopicPartition

    from consumer.config import load_settings
    from consumer.handover import Rebalance
    from consumer.kafka import membership_lost
    from consumer.registry import RegistrySnapshot
    from consumer.worker import Worker
    from engine.config import EngineConfig

    assert not membership_lost(_DroppedMember(0)) and not membership_lost(_DroppedMember(7))
    assert membership_lost(_DroppedMember(-1))
    tp, kept = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    s = load_settings(None, {"worker.spool_path": str(tmp_path / "spool.sqlite"), "worker.revoke_deadline_s": 3600})
    w = Worker(s, SimpleNamespace(config=EngineConfig(max_batch_size=32)),
               SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=SimpleNamespace(root=tmp_path)),
               ledger=None)
    w.consumer = dropped = _DroppedMember(-1)
    w.aengine = engine = _Engine()
    for offset in (0, 1, 2):
        w.offsets.fetched(tp, offset)
    w.offsets.finished(tp, 0)  # done: committable, but not by a dropped member
    running = SimpleNamespace(tp=tp, job=SimpleNamespace(tenant_id="acme", request_id="r1"), abandoned=False)
    other = SimpleNamespace(tp=kept, job=SimpleNamespace(tenant_id="acme", request_id="r2"), abandoned=False)
    w.handover.in_engine.update({1: (None, running), 2: (None, other)})
    with caplog.at_level(logging.INFO, "lorabatch.worker"):
        await asyncio.wait_for(Rebalance(w.handover).on_partitions_revoked({tp}), 30)
    assert running.abandoned and not other.abandoned
    assert engine.aborted == [("acme", "r1")]
    assert dropped.commits == [], "a dropped member commits nothing"
    assert tp not in w.offsets.partitions()
    lines = [r.getMessage() for r in caplog.records]
    assert sum(m.startswith("lost partitions jobs:0:") for m in lines) == 1, lines
    assert len(lines) == 1, lines
    assert w.metrics.registry.get_sample_value("lorabatch_partitions_lost_total") == 1
