"""A job's stages through the worker (consumer.stages), the GPU idle share under it, and the places it keeps in the engine."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from prometheus_client import CollectorRegistry, Histogram

from billing.db import upgrade
from consumer.config import load_settings
from consumer.feeder import Routed
from consumer.outcomes import Served
from consumer.registry import RegistrySnapshot
from consumer.scheduler import Pending
from consumer.schemas import Job, Result
from consumer.stages import STAGES, EngineClock, StageLog, Stamps, stage_summary
from consumer.submit import produce_jobs
from consumer.worker import Worker
from engine.config import EngineConfig
from migrations import SCRIPT_LOCATION
from tests.service_fixtures import open_services, read_all, running_worker, service_settings


def _stamps(key=("t", "r"), base=1_000) -> Stamps:
    s = Stamps(key, fetched=base, parsed=base + 10)
    s.queued = base + 30
    return s


class FakeClock:
    def __init__(self) -> None:
        self.ns = 0

    def __call__(self) -> int:
        return self.ns


def test_started_is_the_engines_queue_time_after_queued_clamped_within_served():
    """started = queued + the engine's queue_us, never before queued nor after served (the clocks round to a us)."""
    for queue_us, expect in ((0, "queued"), (5, "offset"), (10**12, "served")):
        s = _stamps()
        s.served_now(queue_us)
        want = {"queued": s.queued, "offset": s.queued + 5_000, "served": s.served}[expect]
        assert s.started == want and s.queued <= s.started <= s.served


def test_stage_log_finishes_only_jobs_below_the_committed_offset_and_observes_each_stage():
    """A job is done when its partition's commit passes its offset; then its seven stages are observed, in order."""
    registry = CollectorRegistry()
    hist = Histogram("stage_seconds", "x", ["stage"], registry=registry)
    log = StageLog(hist, keep=2)
    tp, other = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    jobs = {offset: _stamps(("t", f"r{offset}")) for offset in (5, 7, 6)}
    for offset, s in jobs.items():
        s.served_now(0)
        log.billed(tp, offset, s)
    assert log.waiting() == 3 and log.done == 0
    log.committed({tp: 7, other: 100})  # next to read is 7: offsets 5 and 6 are committed, 7 is not
    assert log.done == 2 and log.waiting() == 1 and jobs[7].committed == 0
    assert [s.key for s in log.kept] == [("t", "r5"), ("t", "r6")]
    for s in log.kept:
        assert s.published == s.billed, "a job never published is stamped published when billed"
        assert all(d >= 0 for d in s.durations_ns())
    for stage in STAGES:
        assert registry.get_sample_value("stage_seconds_count", {"stage": stage}) == 2
    log.forget({tp})
    assert log.waiting() == 0
    log.committed({tp: 8})
    assert log.done == 2, "a revoked partition's jobs are not this worker's to finish"


def test_stage_log_keeps_at_most_keep_jobs_and_none_by_default():
    log, bounded = StageLog(), StageLog(keep=3)
    tp = TopicPartition("jobs", 0)
    for offset in range(5):
        for lg in (log, bounded):
            s = _stamps(("t", f"r{offset}"))
            s.served_now(0)
            lg.billed(tp, offset, s)
    log.committed({tp: 5})
    bounded.committed({tp: 5})
    assert log.done == 5 and not log.kept
    assert [s.key[1] for s in bounded.kept] == ["r2", "r3", "r4"]


def test_stage_log_holds_at_most_max_waiting_jobs_and_counts_and_says_once_what_it_did_not(caplog):
    """While commits do not pass, at most `max_waiting` jobs' stamps are held (none were dropped, so a broker refusing
    commits grew them by every job billed); a job past the bound has its six known stages observed, its commit stage
    not, and is counted; one line says so, and one more once commits pass again. Revoked partitions free their places."""
    import logging

    from prometheus_client import Counter

    registry = CollectorRegistry()
    hist = Histogram("stage_seconds", "x", ["stage"], registry=registry)
    dropped = Counter("dropped", "x", registry=registry)
    log = StageLog(hist, max_waiting=4, dropped=dropped)
    tp, other = TopicPartition("jobs", 0), TopicPartition("jobs", 1)
    count = registry.get_sample_value
    with caplog.at_level(logging.WARNING, "lorabatch.worker"):
        for offset in range(10):  # no commit passes: the bound holds
            s = _stamps(("t", f"r{offset}"))
            s.served_now(0)
            log.billed(tp if offset % 2 else other, offset, s)
            log.committed({})
        assert log.waiting() == 4 and log.dropped == 6 and count("dropped_total") == 6
        assert count("stage_seconds_count", {"stage": "fetch"}) == 6 and count("stage_seconds_count", {"stage": "commit"}) == 0
        log.committed({tp: 2})  # one job out: still over half the bound, nothing said yet
        assert log.waiting() == 3
        log.forget({other})  # revoked: its held jobs (offsets 0 and 2) leave with it
        assert log.waiting() == 1
        log.committed({tp: 100})
    assert log.waiting() == 0 and log.done == 2 and count("stage_seconds_count", {"stage": "commit"}) == 2
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "have not passed 4 billed jobs" in said[0] and "6 jobs' commit stage" in said[1], said
    s = _stamps(("t", "again"))
    s.served_now(0)
    log.billed(tp, 100, s)
    assert log.waiting() == 1 and log.dropped == 6


def test_stage_summary_of_no_jobs_is_zero_and_of_jobs_is_ordered_per_stage():
    assert stage_summary([]) == {s: {"p50_ms": 0.0, "p99_ms": 0.0} for s in STAGES}
    jobs = []
    for i in range(10):
        s = Stamps(("t", str(i)), 0, 1_000_000 * (i + 1))
        s.queued = s.started = s.served = s.published = s.billed = s.committed = s.parsed
        jobs.append(s)
    summary = stage_summary(jobs)
    assert summary["fetch"] == {"p50_ms": 6.0, "p99_ms": 10.0}
    assert all(summary[s] == {"p50_ms": 0.0, "p99_ms": 0.0} for s in STAGES[1:])


@pytest.mark.parametrize(
    "spans, busy_us, idle",
    [
        ([], 0, None),  # the engine never held a job: no share to speak of
        ([(0, 10_000_000)], 10_000, 0.0),  # busy all along
        ([(0, 10_000_000)], 2_500, 0.75),
        ([(0, 4_000_000), (8_000_000, 12_000_000)], 4_000, 0.5),  # the gap between spans held no job: not idle time
        ([(0, 1_000_000)], 2_000, 0.0),  # steps drained late may exceed the span: clamped
    ],
)
def test_engine_clock_idle_share_counts_only_time_the_engine_held_jobs(spans, busy_us, idle):
    clock = FakeClock()
    ec = EngineClock(clock)
    for start, end in spans:
        clock.ns = start
        ec.enter()
        ec.enter()  # a second job in the same span changes nothing
        ec.leave()
        clock.ns = end
        ec.leave()
    ec.add_steps(busy_us, 3)
    assert ec.idle_share() == idle


def test_engine_clock_counts_an_open_span_and_restarts_on_reset():
    clock = FakeClock()
    ec = EngineClock(clock)
    ec.enter()
    clock.ns = 4_000_000
    ec.add_steps(1_000, 1)
    assert ec.occupied_ns() == 4_000_000 and ec.idle_share() == 0.75
    assert ec.window_idle_share() == 0.75
    clock.ns = 6_000_000
    ec.add_steps(2_000, 1)
    assert ec.window_idle_share() == 0.0  # the last window: 2 ms of steps in 2 ms held
    ec.reset()
    assert ec.busy_us == 0 and ec.steps == 0 and ec.idle_share() is None
    clock.ns = 8_000_000
    assert ec.occupied_ns() == 2_000_000, "a job still in the engine at the reset counts from the reset"


# ---------------------------------------------------------------- the worker


def _bare_worker(tmp_path, engine_batch: int, queue_jobs: int | None) -> Worker:
    """A worker over a stand-in engine of `engine_batch` places and an empty registry; nothing connects."""
    queue = {} if queue_jobs is None else {"worker.engine_queue_jobs": queue_jobs}
    s = load_settings(None, {"worker.max_batch_size": engine_batch, **queue,
                             "worker.spool_path": str(tmp_path / "spool.sqlite"), "worker.headroom_slots": 0})
    engine = SimpleNamespace(config=EngineConfig(max_batch_size=engine_batch))
    registry = SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=None)
    return Worker(s, engine, registry, ledger=None)


def _routed(i: int) -> Pending:
    job = Job(request_id=f"r{i}", tenant_id="t", input_ids=[1, 2, 3], max_new_tokens=1)
    item = Routed(job, SimpleNamespace(view=None), TopicPartition("jobs", 0), i, None, 0)
    return Pending("t", None, 4, time.monotonic(), item)


async def _until(cond, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("queue_jobs", [0, 3, None])
async def test_dispatch_keeps_the_engine_batch_and_engine_queue_jobs_more_in_the_engine(tmp_path, queue_jobs):
    """The worker hands the engine its batch and `worker.engine_queue_jobs` more (they wait in it for a free place;
    unset, another batch), and refills a place as soon as a job comes back; the engine clock counts while any job is
    in the engine."""
    w = _bare_worker(tmp_path, engine_batch=4, queue_jobs=queue_jobs)
    release: dict[str, asyncio.Event] = {}

    async def serve(item, _tier):  # the engine: each job runs until the test releases it
        release[item.job.request_id] = ev = asyncio.Event()
        await ev.wait()
        return Served(None, None, True)

    w.feeder.serve = serve
    for i in range(20):
        w.scheduler.push(_routed(i))
    task = asyncio.create_task(w._dispatch_loop())
    places = 4 + (4 if queue_jobs is None else queue_jobs)
    try:
        w._work_event.set()
        await _until(lambda: len(release) == places, f"{places} jobs in the engine")
        await asyncio.sleep(0.05)  # and no more
        assert len(w._in_engine) == places and len(w.scheduler) == 20 - places
        assert w.engine_clock._jobs == places
        release["r0"].set()
        await _until(lambda: len(release) == places + 1, "the freed place refilled")
        assert len(w._in_engine) == places
    finally:
        task.cancel()
        for ev in release.values():
            ev.set()
        await asyncio.gather(task, return_exceptions=True)
    w.spool.close()


async def test_every_job_through_the_worker_has_seven_ordered_stages_and_an_idle_share(broker, tmp_path, demo_set, cpu_engine):
    """Through the real broker: each job's stamps run fetched <= parsed <= queued <= started <= served <= published
    <= billed <= committed, every stage is observed in the histogram, and the idle share is a share; the worker's
    switch interval holds while it runs."""
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url, script_location=SCRIPT_LOCATION)
    s = await service_settings(broker, tmp_path, url, demo_set["model"], **{"worker.switch_interval_ms": 0.5})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    switch_interval = sys.getswitchinterval()
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    jobs = [Job(request_id=f"s{i}", tenant_id="acme", input_ids=[1, 5, 9, 13 + i], max_new_tokens=2) for i in range(10)]
    async with running_worker(s, svc, cpu_engine) as rw:
        w = rw.worker
        w.stages.kept = type(w.stages.kept)(maxlen=100)  # keep them, as the bench does (Worker(keep_stages=...))
        await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
        results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(jobs))
        assert all(r.status == "succeeded" for r in results)
        await _until(lambda: len(w.stages.kept) == len(jobs), "every job's offset committed", 15)
        idle = await w.gpu_idle_share()
        text = w.metrics.registry.get_sample_value
        counts = {stage: text("lorabatch_stage_seconds_count", {"stage": stage}) for stage in STAGES}
        assert sys.getswitchinterval() == 0.0005  # worker.switch_interval_ms, while the worker runs
    svc.close()
    assert sys.getswitchinterval() == switch_interval, "restored when the worker stops"
    assert {st.key for st in w.stages.kept} == {("acme", j.request_id) for j in jobs}
    for st in w.stages.kept:
        t = (st.fetched, st.parsed, st.queued, st.started, st.served, st.published, st.billed, st.committed)
        assert all(x > 0 for x in t) and list(t) == sorted(t), st
        assert len(st.durations_ns()) == len(STAGES) and all(d >= 0 for d in st.durations_ns())
    assert counts == {stage: len(jobs) for stage in STAGES}
    assert idle is not None and 0.0 <= idle <= 1.0


async def test_while_commits_fail_the_stage_records_stay_bounded_and_every_job_commits_once_they_pass(
        broker, tmp_path, demo_set, cpu_engine, monkeypatch, caplog):
    """Through the real broker, with the group's commits refused (CommitFailedError, as while the group rebalances):
    the worker holds at most its bound of jobs' stamps (it held every job billed: 24 of 24 here, 40,000 in a soak) and
    counts the rest; once commits pass, every job's offset commits, with one result and one ledger row each. The
    refused commits are counted and said in one line, not one each."""
    import logging

    from aiokafka.errors import CommitFailedError

    import consumer.handover as handover_module
    from tests.service_fixtures import committed_vs_end, ledger_rows

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url, script_location=SCRIPT_LOCATION)
    s = await service_settings(broker, tmp_path, url, demo_set["model"])
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    refuse = {"on": True}
    commit = handover_module.commit_in_generation

    async def refused(consumer, offsets):
        if refuse["on"]:
            raise CommitFailedError("the group is rebalancing")
        return await commit(consumer, offsets)

    monkeypatch.setattr(handover_module, "commit_in_generation", refused)
    jobs = [Job(request_id=f"c{i}", tenant_id="acme", input_ids=[1, 5, 9, 13 + i], max_new_tokens=2) for i in range(24)]
    with caplog.at_level(logging.WARNING, "lorabatch.worker"):
        async with running_worker(s, svc, cpu_engine) as rw:
            w = rw.worker
            w.stages.max_waiting = 8
            await produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request")
            await _until(lambda: w.stages.waiting() + w.stages.dropped == len(jobs), "every job billed", 60)
            assert w.stages.waiting() == 8 and w.stages.dropped == 16
            assert w.metrics.registry.get_sample_value("lorabatch_stage_records_dropped_total") == 16
            committed, end = await committed_vs_end(s)
            assert all(c is None for c in committed.values()), committed
            refuse["on"] = False
            await _until(lambda: w.stages.waiting() == 0, "the held jobs committed", 30)
    committed, end = await committed_vs_end(s)
    assert committed == end and sum(end.values()) == len(jobs)
    assert await ledger_rows(svc, len(jobs)) == len(jobs)
    results = await read_all(s, s.kafka.results_topic, Result, lambda got: len(got) >= len(jobs), timeout_s=10)
    assert sorted(r.request_id for r in results) == sorted(j.request_id for j in jobs)
    said = [r.getMessage() for r in caplog.records if "billed jobs" in r.getMessage() or "went unobserved" in r.getMessage()]
    assert len(said) == 2, said
    # the refused commits (one every worker.commit_interval_ms) are counted, and said once a run plus once every 30 s
    refused_commits = w.metrics.registry.get_sample_value("lorabatch_retries_total", {"what": "commit"})
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("commit of", "commits failing"))]
    assert refused_commits >= 3 and 1 <= len(lines) <= 2, (refused_commits, lines)
    assert sum(r.getMessage().startswith("commits succeed again") for r in caplog.records) == 1
    svc.close()


def test_bench_pipeline_cpu_run_prints_its_figures(capsys, tmp_path, monkeypatch):
    """`lorabatch bench pipeline` on the CPU: one JSON line with the engine against the service, the idle shares and
    each stage's p50/p99 over every job. (A batch of 8 under the usual config file: the warm-ups run two batches.)"""
    from consumer.bench.pipeline import bench_pipeline

    config = tmp_path / "lorabatch.toml"
    config.write_text("[engine]\nmax_batch_size = 8\n[worker]\nmax_batch_size = 8\n")
    monkeypatch.setenv("LORABATCH_CONFIG", str(config))
    figures = bench_pipeline(jobs=6, json_only=True, new_tokens=2, rounds=2)
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line == figures
    for key in ("jobs", "cache", "engine_jobs_per_s", "pipeline_jobs_per_s", "engine_tok_s", "pipeline_tok_s", "ratio",
                "pipeline_cost_pct", "routing_p50_ms", "routing_p99_ms", "engine_gpu_idle_share", "gpu_idle_share"):
        assert key in line, key
    assert line["device"] == "cpu" and line["shape"] == "tiny" and line["jobs"] == 12 and line["rounds"] == 2
    assert len(line["round_ratios"]) == 2 and all(r > 0 for r in line["round_ratios"])
    assert line["engine_steps"] > 0 and line["service_steps"] > 0 and line["engine_batch"] == 8
    assert line["staged_jobs"] == 12 and line["not_succeeded"] == 0  # every round's jobs billed once
    assert set(line["stages"]) == set(STAGES)
    assert all(v["p50_ms"] >= 0 and v["p99_ms"] >= v["p50_ms"] for v in line["stages"].values())
    assert 0 <= line["gpu_idle_share"] <= 1 and 0 <= line["engine_gpu_idle_share"] <= 1
