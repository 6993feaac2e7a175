"""Tenant rate limits at their edges: a negative limit a hand-written registry row holds, 0 (unlimited), a tenant with no
policy, and a request id sent twice while its first copy waits for the quota (counted once)."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from consumer.config import Settings
from consumer.intake import Intake, estimate_tokens
from consumer.metrics import WorkerMetrics
from consumer.routing import Route
from consumer.scheduler import Pending, Scheduler, TenantPolicy
from consumer.schemas import parse_job
from consumer.tenants import TenantView

TP = TopicPartition("jobs", 0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("policy", [TenantPolicy(1, -5, 0), TenantPolicy(1, 0, -100), TenantPolicy(1, -1, -1)])
def test_a_negative_limit_serves_the_tenant_unlimited_and_says_so(policy, caplog):
    """`tenants limits` refuses a negative limit, but a row changed by hand (`UPDATE tenants SET
    requests_per_minute = -1`, "unlimited" in many systems) holds one: as a bucket it let the tenant's first job through
    and then none, for good, while next_eligible_in answered 0 (the dispatch loop woke every 5 ms for nothing). It is
    served as unlimited, with a warning naming the tenant, the field and the command that sets it."""
    clock = Clock()
    s = Scheduler(8, 10_000, 8, clock=clock)
    with caplog.at_level(logging.WARNING, logger="lorabatch.worker"):
        s.set_policy("acme", policy)
        s.set_policy("acme", policy)  # the next registry refresh: said once, not every refresh
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == (policy.requests_per_minute < 0) + (policy.tokens_per_minute < 0), lines
    assert all("'acme'" in line and "lorabatch tenants limits acme" in line for line in lines), lines
    for i in range(20):
        s.push(Pending("acme", None, 10, 0.0, i))
    assert len(s.pop_batch()) == 8 and len(s.pop_batch()) == 8 and len(s.pop_batch()) == 4
    assert s.next_eligible_in() is None and not s.over_quota("acme", 10**6)


def test_zero_limits_and_a_tenant_without_a_policy_are_unlimited():
    s = Scheduler(8, 10**9, 8, clock=Clock())
    s.set_policy("zero", TenantPolicy(1, 0, 0))
    for tenant in ("zero", "nobody"):
        assert not s.over_quota(tenant, 10**9)
        for i in range(100):
            s.push(Pending(tenant, None, 10**6, 0.0, i))
    assert sum(len(s.pop_batch()) for _ in range(25)) == 200


class _BaseRouter:
    async def route_batch(self, snapshot, classifier, jobs):
        return [Route(None, "base_model", 5) for _ in jobs]


def test_a_request_id_sent_twice_is_queued_and_charged_once():
    """Two copies of one request id, in one fetch and in the next, on_quota="fail", with a tokens-per-minute limit that
    holds the job once but not twice: the first is queued, the copies wait for its answer, none fails quota_exceeded,
    and the tenant's bucket is charged for one job."""
    clock = Clock()
    settings = Settings()
    scheduler = Scheduler(8, 8192, 4, clock=clock)
    value = json.dumps({"request_id": "r1", "tenant_id": "acme", "prompt": "hello", "max_new_tokens": 100,
                        "on_quota": "fail"}).encode()
    tokens = estimate_tokens(parse_job(value), settings.engine)
    scheduler.set_policy("acme", TenantPolicy(1, 0, tokens + tokens // 2))
    intake = Intake(settings, WorkerMetrics(), "w1", scheduler, _BaseRouter(), None, None, asyncio.Event(),
                    SimpleNamespace(rules=[], tenants={"acme": TenantView("acme", "Acme", "standard", 1, 0, tokens + tokens // 2)}))
    intake.stored = lambda keys: _nothing()
    emitted: list = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)

    def message(offset):
        return SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=offset, timestamp=1_000 + offset,
                               value=value, key=None, headers=())

    asyncio.run(intake.ingest([(TP, message(0), 1), (TP, message(1), 1)]))
    asyncio.run(intake.ingest([(TP, message(2), 1)]))
    assert not emitted, [o.result.error for o in emitted]
    assert (len(scheduler), scheduler.queued_tokens, intake.parked) == (1, tokens, 2)
    (p,) = scheduler.pop_batch()
    assert scheduler._bucket("acme")[1].level == pytest.approx(tokens // 2)


async def _nothing():
    return {}


def test_a_worker_restart_starts_every_bucket_full():
    """What persists: nothing. Buckets live in the worker's memory (README, partitioning contract), so a restarted worker
    gives a tenant that had spent its minute a full bucket again; this pins that down, as the README says."""
    clock = Clock()
    s = Scheduler(8, 10_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 1, 0))
    s.push(Pending("acme", None, 10, 0.0, "a"))
    assert len(s.pop_batch()) == 1 and s.over_quota("acme", 10)
    again = Scheduler(8, 10_000, 8, clock=clock)
    again.set_policy("acme", TenantPolicy(1, 1, 0))
    assert not again.over_quota("acme", 10)


def test_quota_exceeded_names_a_negative_limit_unlimited():
    """A tenant with requests_per_minute=-1 written by hand (served as unlimited) and 150 tokens a minute: a job over the
    tokens fails quota_exceeded with a message that calls the requests unlimited, as they are served; it said "-1
    requests" per minute, a limit that reads as "none allowed" beside a refusal for tokens."""
    settings = Settings()
    scheduler = Scheduler(8, 8192, 4, clock=Clock())
    scheduler.set_policy("acme", TenantPolicy(1, -1, 150))
    intake = Intake(settings, WorkerMetrics(), "w1", scheduler, _BaseRouter(), None, None, asyncio.Event(),
                    SimpleNamespace(rules=[], tenants={"acme": TenantView("acme", "Acme", "standard", 1, -1, 150)}))
    intake.stored = lambda keys: _nothing()
    emitted: list = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)
    value = json.dumps({"request_id": "big", "tenant_id": "acme", "prompt": "hi", "max_new_tokens": 100,
                        "on_quota": "fail"}).encode()
    scheduler.push(Pending("acme", None, 150, 0.0, "ahead"))  # the minute's tokens, queued ahead of it
    asyncio.run(intake.ingest([(TP, SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=0, timestamp=1,
                                                    value=value, key=None, headers=()), 1)]))
    (o,) = emitted
    assert o.result.error.code == "quota_exceeded", o.result.error
    assert "unlimited requests, 150 tokens per minute" in o.result.error.message, o.result.error.message
