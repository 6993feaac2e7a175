"""Translations between the job contract, the engine's types and the ledger's records, and `Served`, what
serving one routed job gives back to the worker."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from billing.credit import kv_credit_us
from billing.records import UsageRecord
from consumer.delivery import Outcome
from consumer.schemas import Cost, ErrorInfo, Job, Result, Timings, Usage
from engine.api import ADAPTER_ERROR_CODES, EngineError, GenerationRequest, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from consumer.registry import AdapterView

log = logging.getLogger("lorabatch.worker")  # serving_error speaks for the worker serving the job


def to_request(job: Job, adapter_key: str | None, arrival_us: int | None = None) -> GenerationRequest:
    return GenerationRequest(
        request_id=job.request_id,
        prompt=job.prompt,
        messages=tuple(m.model_dump() for m in job.messages) if job.messages is not None else None,
        input_ids=tuple(job.input_ids) if job.input_ids is not None else None,
        adapter_key=adapter_key,
        sampling=SamplingParams(
            max_new_tokens=job.max_new_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            top_k=job.top_k,
            seed=job.seed,
            stop=tuple(job.stop),
            logprobs=job.logprobs,
        ),
        priority=job.priority,
        tenant_id=job.tenant_id,
        allow_base_fallback=job.allow_base_fallback,
        arrival_us=arrival_us,
    )


def _ms(us: int) -> float:
    return round(us / 1000, 3)


@dataclass(frozen=True)
class Served:
    """What serving one routed job gives back: its outcome to deliver, and what the adapter's circuit counts."""

    outcome: Outcome | None  # None when abandoned (its partition was revoked): nothing is published
    adapter_key: str | None  # the engine key of the adapter the route chose (even when the request fell back); None: the base model
    adapter_ok: bool  # False only when the adapter itself failed (engine.api.ADAPTER_ERROR_CODES, or a fallback)


def quota_tokens(outcome: Outcome) -> int:
    """The tokens a job the engine answered ran, to which its tenant's token quota is settled: its prompt and what it
    generated (a stop string or EOS ends it before max_new_tokens), or 0 when it took no GPU time (refused by the
    engine: a prompt or max_new_tokens over its limit, an adapter that cannot load)."""
    u = outcome.usage
    if u is not None:
        return u.input_tokens + u.output_tokens if u.base_us + u.lora_us > 0 else 0
    r = outcome.result  # an answer with no row (nobody bills it): as its result says
    if r is None or r.usage is None or not (r.cost and r.cost.base_ms + r.cost.lora_ms > 0):
        return 0
    return r.usage.input_tokens + r.usage.output_tokens


def engine_error_field(code: str, message: str, job: Job) -> str | None:
    """The job field an engine refusal is about (engine.validation's codes), so a result never says `field: null`
    for a fault of one field."""
    given = next((k for k in ("prompt", "messages", "input_ids") if getattr(job, k) is not None), None)
    if code in ("max_new_tokens_too_large",):
        return "max_new_tokens"
    if code in ("prompt_too_long", "empty_prompt", "invalid_input_ids", "invalid_messages", "no_chat_template"):
        return given
    if code == "invalid_sampling_params" and message.startswith("sampling: "):
        name = message.removeprefix("sampling: ").split("=", 1)[0]
        return name if name in Job.model_fields else None
    if code.startswith("adapter_") or code == "unknown_adapter":
        return "adapter_ref"
    if code == "duplicate_request_id":  # `lorabatch generate`: a file giving one request_id on two lines
        return "request_id"
    return None


def succeeded_or_failed(job: Job, out: GenerationResult, worker_id: str, *, adapter: str | None, adapter_sha256: str | None,
                        route_reason: str, routing_us: int, finished_at: datetime,
                        tier: str | None = None) -> tuple[Result, UsageRecord]:
    """The result and ledger row of a job the engine ran: `adapter` is the `name@version` it ran on (None: the
    base model), `routing_us` the routing decision, `finished_at` the instant its result reached the worker (its
    row's month and prices), `tier` its tenant's tier as routed (None: not registered). The
    row keeps the KV saving the engine measured; the result's `kv_saved_ms` is the credit billed for it
    (billing.credit), never more than the request's base + LoRA time."""
    t = out.timings
    error = None
    if out.error is not None:
        error = ErrorInfo(code=out.error.code, message=out.error.message, retriable=out.error.retriable,
                          field=engine_error_field(out.error.code, out.error.message, job))
    result = Result(
        request_id=job.request_id,
        tenant_id=job.tenant_id,
        batch_id=job.batch_id,
        adapter=adapter,
        status="succeeded" if error is None else "failed",
        text=out.text,
        output_ids=out.output_ids,
        finish_reason=out.finish_reason,
        logprobs=out.logprobs,
        usage=Usage(input_tokens=out.prompt_tokens, output_tokens=len(out.output_ids), cached_tokens=t.cached_tokens),
        cost=Cost(base_ms=_ms(t.base_us), lora_ms=_ms(t.lora_us), routing_ms=_ms(routing_us), kv_saved_ms=_ms(kv_credit_us(
            kv_saved_us=t.kv_saved_us, base_us=t.base_us, lora_us=t.lora_us, input_tokens=out.prompt_tokens,
            cached_tokens=t.cached_tokens, output_tokens=len(out.output_ids)))),
        timings=Timings(queue_ms=_ms(t.queue_us), ttft_ms=_ms(t.ttft_us), total_ms=_ms(t.total_us)),
        route=route_reason,
        error=error,
        worker_id=worker_id,
    )
    usage = UsageRecord(
        tenant_id=job.tenant_id,
        request_id=job.request_id,
        status=result.status,
        created_at=finished_at,
        adapter=adapter,
        adapter_sha256=adapter_sha256,
        batch_id=job.batch_id,
        route_reason=route_reason,
        error_code=error.code if error else None,
        input_tokens=result.usage.input_tokens,
        output_tokens=result.usage.output_tokens,
        cached_tokens=result.usage.cached_tokens,
        base_us=t.base_us,
        lora_us=t.lora_us,
        routing_us=routing_us,
        kv_saved_us=t.kv_saved_us,
        queue_us=t.queue_us,
        ttft_us=t.ttft_us,
        total_us=t.total_us,
        worker_id=worker_id,
        tier=tier,
    )
    return result, usage


def failed_before_engine(
    job_ids: tuple[str, str, str | None], error: ErrorInfo, answered_at: datetime, worker_id: str,
    route_reason: str = "", routing_us: int = 0, bill: bool = True, adapter: AdapterView | None = None, tier: str | None = None,
) -> tuple[Result, UsageRecord | None]:
    """A job that never reached the engine: a failed result and, for a known tenant, a row of no GPU time (its routing
    decision alone). `adapter`: the adapter chosen for it whose own fault failed it, named by the result and the row
    (its invoice line, as when the engine finds the fault), else None (the `base` line: no adapter was chosen). `tier`:
    the tenant's tier in the registry snapshot the worker went by (None: not registered), on the row. `answered_at`: when
    the worker answered it, its row's month."""
    request_id, tenant_id, batch_id = job_ids
    result = Result(
        request_id=request_id, tenant_id=tenant_id, batch_id=batch_id, adapter=adapter.adapter if adapter else None,
        status="failed", route=route_reason, error=error, worker_id=worker_id, cost=Cost(routing_ms=_ms(routing_us)),
    )
    usage = None
    if bill:
        usage = UsageRecord(
            tenant_id=tenant_id, request_id=request_id, status="failed", created_at=answered_at,
            adapter=adapter.adapter if adapter else None, adapter_sha256=adapter.sha256 if adapter else None,
            batch_id=batch_id, route_reason=route_reason, error_code=error.code, routing_us=routing_us, worker_id=worker_id,
            tier=tier,
        )
    return result, usage


def serving_error(e: Exception, key: tuple[str, str]) -> tuple[ErrorInfo, bool]:
    """What a job whose serving raised `e` is answered with, and whether that answer is the request's to keep (billed,
    and replayed to a resend): the engine process lost (its code), the adapter's files unreadable (a store moved or
    emptied under the worker: its code and message, not "the worker failed" with the cause only in the log), or a bug
    of ours (engine_error, retriable: not kept, so that a resend runs again, where it replayed the failure for good)."""
    if isinstance(e, EngineError) and e.code == "engine_failed":
        return ErrorInfo(code=e.code, message=str(e), retriable=e.retriable), True
    if isinstance(e, EngineError) and e.code in ADAPTER_ERROR_CODES:
        log.error("serving %s/%s: its adapter cannot be loaded: %s", *key, e)
        return ErrorInfo(code=e.code, message=str(e), field="adapter_ref", retriable=e.retriable), not e.retriable
    log.error("serving %s/%s failed", *key, exc_info=e)
    return ErrorInfo(code="engine_error", message="the worker failed on this job; it was logged, and the same request_id "
                     "may be sent again", retriable=True), False
