"""A result's cost says what the ledger row holds: lora_ms is the LoRA compute, routing_ms the routing decision alone."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from consumer.answers import stored_result
from consumer.outcomes import failed_before_engine, succeeded_or_failed, to_request
from consumer.schemas import ErrorInfo, Job
from engine.api import GenerationResult, RequestTimings

AT = datetime(2026, 10, 3, tzinfo=UTC)
JOB = Job(request_id="r1", tenant_id="acme", prompt="hi", adapter_ref="support")


@pytest.mark.parametrize(
    ("base_us", "lora_us", "routing_us", "kv_saved_us"),
    [(0, 0, 0, 0), (40_000, 6_000, 300, 46_000), (1, 2**40, 7, 0), (123_456, 0, 1_999, 5)],
)
def test_cost_splits_lora_from_the_routing_decision(base_us: int, lora_us: int, routing_us: int, kv_saved_us: int) -> None:
    """cost.lora_ms is the engine's LoRA share and cost.routing_ms the decision alone, each the row's microseconds in ms."""
    out = GenerationResult(request_id="r1", adapter_key="acme/support@2", tenant_id="acme", output_ids=[5, 6], prompt_tokens=3,
                           timings=RequestTimings(base_us=base_us, lora_us=lora_us, kv_saved_us=kv_saved_us))
    result, usage = succeeded_or_failed(JOB, out, "w0", adapter="support@2", adapter_sha256="ab" * 32, route_reason="explicit",
                                        routing_us=routing_us, finished_at=AT)
    assert (result.adapter, usage.adapter) == ("support@2", "support@2")
    assert (usage.base_us, usage.lora_us, usage.routing_us, usage.kv_saved_us) == (base_us, lora_us, routing_us, kv_saved_us)
    cost = result.cost
    assert (cost.base_ms, cost.lora_ms, cost.routing_ms) == (round(base_us / 1000, 3), round(lora_us / 1000, 3), round(routing_us / 1000, 3))
    # The answer rebuilt from the row (rows older than the stored bodies) says the same.
    again = stored_result(("acme", "r1"), None, SimpleNamespace(**dataclasses.asdict(usage)))
    assert (again.cost.lora_ms, again.cost.routing_ms) == (lora_us / 1000, routing_us / 1000)


@pytest.mark.parametrize(
    ("timings", "prompt_tokens", "output_ids", "credit_us"),
    [
        # 112 of 120 prompt tokens cached, 13 computed: the whole 173 ms charge is credited, not the 507 ms measured
        (dict(base_us=38_284, lora_us=134_721, kv_saved_us=506_817, cached_tokens=112), 120, [5] * 5, 173_005),
        # 48 of 120 cached, 73 computed: at most 48/73 of the charge
        (dict(base_us=99_912, lora_us=790_273, kv_saved_us=982_290, cached_tokens=48), 120, [5], 585_327),
        (dict(base_us=9_000, lora_us=1_000, kv_saved_us=4_000, cached_tokens=96), 120, [5] * 8, 4_000),  # under the cap
        (dict(base_us=0, lora_us=0, kv_saved_us=7_000, cached_tokens=16), 0, [], 0),  # failed: nothing computed, no credit
    ],
)
def test_the_published_kv_credit_is_the_one_billed(timings: dict, prompt_tokens: int, output_ids: list[int], credit_us: int) -> None:
    """A result's kv_saved_ms is the KV credit its invoice line takes (billing.credit: never more than base + LoRA), not
    the engine's measured saving, which the ledger row keeps: a tenant summing its results' costs met a credit several
    times its charge (a net of -334 ms on a 173 ms request) that no invoice gave."""
    out = GenerationResult(request_id="r1", adapter_key="acme/support@2", tenant_id="acme", output_ids=output_ids,
                           prompt_tokens=prompt_tokens, timings=RequestTimings(**timings))
    result, usage = succeeded_or_failed(JOB, out, "w0", adapter="support@2", adapter_sha256="ab" * 32, route_reason="explicit",
                                        routing_us=0, finished_at=AT)
    assert usage.kv_saved_us == timings["kv_saved_us"]  # the measurement
    assert result.cost.kv_saved_ms == credit_us / 1000 <= result.cost.base_ms + result.cost.lora_ms
    again = stored_result(("acme", "r1"), None, SimpleNamespace(**dataclasses.asdict(usage)))
    assert again.cost.kv_saved_ms == credit_us / 1000


def test_a_job_that_never_ran_costs_its_routing_decision_alone() -> None:
    """A failure before the engine carries its decision time as routing_ms and no LoRA time."""
    result, usage = failed_before_engine(("r1", "acme", None), ErrorInfo(code="unknown_adapter", message="m"), AT, "w0",
                                         route_reason="explicit", routing_us=1_234)
    assert (result.cost.routing_ms, result.cost.lora_ms) == (1.234, 0.0)
    assert usage is not None and (usage.routing_us, usage.lora_us) == (1_234, 0)


def test_the_engine_request_carries_the_adapter_key_and_tenant_id() -> None:
    """The job's adapter_ref is not the engine's key: to_request takes the adapter_key the route resolved."""
    req = to_request(JOB, "acme/support@2", 17)
    assert (req.adapter_key, req.tenant_id, req.arrival_us) == ("acme/support@2", "acme", 17)
    assert to_request(JOB, None).adapter_key is None
