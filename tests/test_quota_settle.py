"""Tenant quotas settle to what a job ran: a job takes its estimate (prompt + max_new_tokens) from its tenant's token
bucket when it is dispatched, and when it leaves the engine the bucket is set to what it ran (its prompt and the tokens
it generated). Before, a job that stopped early (a stop string, EOS) kept its whole max_new_tokens charged, a job the
engine refused or that failed kept all of it, and a prompt the estimate undercounted (CJK text, ~1 token a character
against the estimate's 3 characters a token) ran over its tenant's limit without paying the difference.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from consumer.config import Settings
from consumer.feeder import Routed
from consumer.intake import estimate_tokens
from consumer.outcomes import Served, quota_tokens, succeeded_or_failed
from consumer.routing import Route
from consumer.scheduler import Pending, Scheduler, TenantPolicy, TokenBucket
from consumer.schemas import parse_job
from consumer.worker import Worker
from engine.api import EngineError, GenerationResult, RequestTimings

TP = TopicPartition("jobs", 0)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _job(rid: str, **fields):
    body = {"request_id": rid, "tenant_id": "acme", "input_ids": [1] * 8, "max_new_tokens": 200, **fields}
    return parse_job(json.dumps(body).encode())


def _result(job, out_tokens: int, *, base_us: int = 5_000, prompt: int = 8, error=None, finish="stop"):
    return GenerationResult(job.request_id, None, "acme", output_ids=[7] * out_tokens, text="x" * out_tokens,
                            finish_reason=None if error else finish, prompt_tokens=prompt, error=error,
                            timings=RequestTimings(base_us=base_us, total_us=base_us))


class _Feeder:
    def __init__(self, answer):
        self.answer = answer

    async def serve(self, item, slo_tier):
        if isinstance(self.answer, Exception):
            raise self.answer
        result, usage = succeeded_or_failed(item.job, self.answer(item.job), "w1", adapter=None, adapter_sha256=None,
                                            route_reason="base_model", routing_us=5, finished_at=datetime.now(UTC))
        return Served(SimpleNamespace(result=result, usage=usage), None, True)


def _serve_one(scheduler: Scheduler, job, answer) -> list:
    """Dispatch `job` through the scheduler and the worker's own _serve, the engine answering `answer`."""
    answered: list = []
    item = Routed(job, Route(None, "base_model", 5), TP, 0, datetime.now(UTC), 0)
    scheduler.push(Pending("acme", None, estimate_tokens(job, Settings().engine), 0.0, item, partition=TP))
    (p,) = scheduler.pop_batch()
    worker = SimpleNamespace(
        feeder=_Feeder(answer), worker_id="w1", _in_engine={id(p): (p, item)}, scheduler=scheduler,
        engine_clock=SimpleNamespace(leave=lambda: None), handover=SimpleNamespace(revoked=set()),
        _work_event=asyncio.Event(), breakers=SimpleNamespace(record=lambda *a: None, no_verdict=lambda *a: None),
        intake=SimpleNamespace(snapshot=SimpleNamespace(tenants={}), answer=lambda key, o, keep=True: answered.append(o)))
    asyncio.run(Worker._serve(worker, p))
    return answered


def _levels(s: Scheduler) -> tuple[float, float]:
    reqs, toks = s._bucket("acme")
    return reqs.level, toks.level


def test_a_job_stopped_early_gives_back_the_tokens_it_did_not_generate():
    """max_new_tokens=200, stopped by a stop string after 3: the bucket keeps 8 + 3 = 11 of the 208 it took."""
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 0, 1_000))
    answered = _serve_one(s, _job("early", stop=["."]), lambda job: _result(job, 3))
    assert answered[0].result.status == "succeeded"
    assert _levels(s)[1] == pytest.approx(1_000 - 11)


@pytest.mark.parametrize("answer", [
    # the engine refused it before running a token (no GPU time): all of its estimate comes back
    (lambda job: _result(job, 0, base_us=0, error=EngineError("over", code="prompt_too_long"))),
    # our failure, not kept (a resend runs again): its tokens and its request come back
    RuntimeError("a bug of ours"),
])
def test_a_job_that_ran_nothing_gives_back_its_whole_estimate(answer):
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 10, 1_000))
    _serve_one(s, _job("refused"), answer)
    reqs, toks = _levels(s)
    assert toks == pytest.approx(1_000)
    assert reqs == pytest.approx(10 if isinstance(answer, Exception) else 9)  # a kept answer was a request


def test_a_prompt_the_estimate_undercounted_pays_the_rest():
    """A CJK prompt of 300 characters is estimated at 101 tokens and ran as 300: its tenant pays the 199 more, so a
    tenant cannot run three times its tokens per minute by writing its prompts in Chinese."""
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 0, 10_000))
    job = parse_job(json.dumps({"request_id": "cjk", "tenant_id": "acme", "prompt": "你" * 300,
                                "max_new_tokens": 10}).encode())
    assert estimate_tokens(job, Settings().engine) == 111
    _serve_one(s, job, lambda j: _result(j, 10, prompt=300, finish="length"))
    assert _levels(s)[1] == pytest.approx(10_000 - 310)


def test_settling_never_fills_a_bucket_past_its_limit_nor_touches_an_unlimited_one():
    b = TokenBucket(100, now=0.0)
    b.take(50, 0.0)
    b.give(500, 0.0)
    assert b.level == 100
    unlimited = TokenBucket(0, now=0.0)
    unlimited.give(-10**9, 0.0)
    assert unlimited.can_take(10**9, 0.0)


def test_a_quota_exactly_at_its_limit_passes_then_waits_until_the_refill():
    """tokens_per_minute=208: one job of 208 tokens passes a full bucket, the next waits; early stops refill it."""
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 0, 208))
    assert not s.over_quota("acme", 208)
    _serve_one(s, _job("a"), lambda job: _result(job, 200, finish="length"))  # ran all 208
    assert s.over_quota("acme", 208) and s.over_quota("acme", 1)
    clock.t = 60.0
    assert not s.over_quota("acme", 208)


def test_many_tiny_early_stops_are_not_throttled_by_their_max_new_tokens():
    """A tenant of 2,000 tokens a minute sends jobs of max_new_tokens=200 that answer in 1 token: 9 tokens each, so
    200 of them run in the minute (charged at max_new_tokens, 9 did and the rest waited)."""
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 0, 2_000))
    for i in range(200):
        assert not s.over_quota("acme", 208), i
        _serve_one(s, _job(f"t{i}"), lambda job: _result(job, 1, finish="eos"))
    assert _levels(s)[1] == pytest.approx(2_000 - 200 * 9)


def test_quota_tokens_reads_the_row_or_the_result():
    job = _job("q")
    result, usage = succeeded_or_failed(job, _result(job, 4), "w1", adapter=None, adapter_sha256=None,
                                        route_reason="base_model", routing_us=5, finished_at=datetime.now(UTC))
    assert quota_tokens(SimpleNamespace(result=result, usage=usage)) == 12
    assert quota_tokens(SimpleNamespace(result=result, usage=None)) == 12
    assert quota_tokens(SimpleNamespace(result=None, usage=None)) == 0


class _Revoked:
    """An engine that answers once the job's partition was revoked under it (the rebalance abandons it)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    async def serve(self, item, slo_tier):
        item.abandoned = True
        if self.fail:  # the engine process died under it, as a rebalance's abort can find it: a failure kept
            raise EngineError("the engine process exited", code="engine_failed")
        return Served(None, None, True)


@pytest.mark.parametrize("fail", [False, True])
def test_a_job_abandoned_on_a_revoke_gives_back_its_estimate_and_its_request(fail):
    """A job running when its partition was revoked is abandoned: its result is not published nor billed, and the
    partitions' next owner runs it again, under an eager rebalance most often this same worker. It kept its whole
    estimate and its request charged, so the run again paid a second time for one job (208 tokens of a job that answers
    in 11, and 2 requests for 1)."""
    clock = Clock()
    s = Scheduler(8, 100_000, 8, clock=clock)
    s.set_policy("acme", TenantPolicy(1, 10, 1_000))
    job = _job("revoked")
    item = Routed(job, Route(None, "base_model", 5), TP, 0, datetime.now(UTC), 0)
    s.push(Pending("acme", None, estimate_tokens(job, Settings().engine), 0.0, item, partition=TP))
    (p,) = s.pop_batch()
    orphaned: list = []

    async def _orphaned(key, revoked):
        orphaned.append(key)

    worker = SimpleNamespace(
        feeder=_Revoked(fail), worker_id="w1", _in_engine={id(p): (p, item)}, scheduler=s,
        engine_clock=SimpleNamespace(leave=lambda: None), handover=SimpleNamespace(revoked={TP}),
        _work_event=asyncio.Event(), breakers=SimpleNamespace(record=lambda *a: None, no_verdict=lambda *a: None),
        intake=SimpleNamespace(snapshot=SimpleNamespace(tenants={}), answer=lambda *a, **k: None, orphaned=_orphaned))
    asyncio.run(Worker._serve(worker, p))
    assert orphaned == [("acme", "revoked")]
    assert _levels(s) == (pytest.approx(10), pytest.approx(1_000))
    _serve_one(s, _job("revoked", stop=["."]), lambda j: _result(j, 3))  # its run again, on the partition's return
    assert _levels(s) == (pytest.approx(9), pytest.approx(1_000 - 11))
