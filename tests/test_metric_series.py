"""The worker's Prometheus series follow what it holds: a partition taken away by a rebalance leaves its gauges."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest

import pytest
from aiokafka import TopicPartition

from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.partitions import Partitions

TPS = [TopicPartition("jobs", i) for i in range(4)]


def _lag_series(metrics: WorkerMetrics) -> dict[str, float]:
    (family,) = [m for m in metrics.registry.collect() if m.name == "lorabatch_consumer_lag"]
    return {s.labels["partition"]: s.value for s in family.samples}


@pytest.mark.parametrize("assignments, expected", [
    ([set()], {}),
    ([set(TPS)], {"0": 90, "1": 90, "2": 90, "3": 90}),
    ([set(TPS), {TPS[1], TPS[3]}], {"1": 90, "3": 90}),  # a rebalance gave 0 and 2 to another worker
    ([set(TPS), set()], {}),  # all of them
    ([set(TPS), {TPS[1]}, {TPS[0], TPS[1]}], {"0": 90, "1": 90}),  # 0 came back
])
def test_lag_is_shown_for_the_assigned_partitions_only(assignments, expected):
    """A partition revoked in a rebalance leaves lorabatch_consumer_lag: its last figure stayed on, frozen, beside the
    new owner's (976 behind on a worker that no longer read it), so a sum over the workers counted it twice."""
    offsets = OffsetTracker()
    for tp in TPS:
        offsets.fetched(tp, 19)  # the next fetch is at 20
    consumer = SimpleNamespace(assignment=lambda: assigned, highwater=lambda tp: 110)
    metrics = WorkerMetrics()
    partitions = Partitions(consumer, offsets, metrics)
    for assigned in assignments:
        partitions.report_lag()
    assert _lag_series(metrics) == expected


@pytest.mark.parametrize("registered, tenant, label", [
    ({"acme"}, "acme", "acme"),
    ({"acme"}, "ghost", "(unregistered)"),
    ({"acme", "unknown"}, "unknown", "unknown"),
    ({"acme", "unknown"}, "x9f3", "(unregistered)"),
])
def test_unregistered_tenants_never_share_a_registered_tenants_label(registered, tenant, label):
    """Jobs of unregistered tenants were counted under tenant="unknown", a valid tenant id: a tenant registered as
    `unknown` then had every stray tenant's requests in its own series. Their label is one no tenant id can be."""
    from consumer.delivery import Deliverer
    from consumer.schemas import Result

    metrics = WorkerMetrics()
    counter = SimpleNamespace(metrics=metrics, known_tenant=lambda t: t in registered)
    Deliverer._count(counter, Result(request_id="r1", tenant_id=tenant, status="failed"))
    (family,) = [m for m in metrics.registry.collect() if m.name == "lora_request"]
    assert [(s.labels["tenant"], s.value) for s in family.samples if s.name == "lora_request_total"] == [(label, 1.0)]


def test_every_metric_the_worker_serves_is_named_in_the_readme():
    """An SRE reads the README for what a series means: six of them (lorabatch_batches_total, lorabatch_batch_size,
    lorabatch_replayed_results_total, lorabatch_fetch_errors_total, lorabatch_undeliverable_total,
    lora_adapter_circuits_open) were served and named nowhere."""
    from pathlib import Path

    readme = Path(__file__).parent.parent.joinpath("README.md").read_text()
    served = {f.name + ("_total" if f.type == "counter" else "") for f in WorkerMetrics().registry.collect()}
    assert {n for n in served if f"`{n}`" not in readme and f"`{n}{{" not in readme} == set()


def test_request_durations_of_a_backlog_stay_in_buckets_up_to_an_hour() -> None:
    """A job that waited 5 or 20 minutes behind a backlog lands in a bucket of its own: the histogram stopped at 120 s,
    so every wait past two minutes was one +Inf count and a backlog's p99 could not be read."""
    m = WorkerMetrics()
    for seconds in (200, 500, 1200, 3000):
        m.duration.labels("acme").observe(seconds)
    text = generate_latest(m.registry).decode()
    for le, count in (("120.0", 0), ("300.0", 1), ("600.0", 2), ("1800.0", 3), ("3600.0", 4)):
        assert f'lora_request_duration_seconds_bucket{{le="{le}",tenant="acme"}} {count}.0' in text, (le, text)
