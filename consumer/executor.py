"""Running routed jobs on the engine, in the engine's own thread, and turning its results into outcomes.

Adapters are loaded on first use; a load that fails fails its jobs with the engine's code, or runs them
on the base model where the job allows it. If the engine raises on a whole batch (a bug or an
out-of-memory), the batch is retried one request at a time so that one bad request fails alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime

from aiokafka import TopicPartition

from billing.records import AdapterLoadRecord, BusyRecord
from consumer.delivery import Outcome
from consumer.outcomes import Served, failed_before_engine, succeeded_or_failed, to_request
from consumer.routing import Route
from consumer.schemas import ErrorInfo, Job
from engine.api import AdapterError, EngineError, GenerationResult
from engine.store import AdapterStore

log = logging.getLogger("lorabatch.worker")


@dataclass
class Routed:
    job: Job
    route: Route
    tp: TopicPartition
    offset: int
    received_at: datetime
    received_mono_us: int


@dataclass
class BatchOutput:
    outcomes: list[Outcome] = field(default_factory=list)
    loads: list[AdapterLoadRecord] = field(default_factory=list)
    adapter_ok: list[tuple[str, bool]] = field(default_factory=list)  # for the circuit breakers
    busy: BusyRecord | None = None  # the GPU time the batch's steps measured, for period conservation


class BatchExecutor:
    def __init__(self, engine, store: AdapterStore, worker_id: str, gpu_kind: str):
        self.engine = engine
        self.store = store
        self.worker_id = worker_id
        self.gpu_kind = gpu_kind

    def run(self, items: list[Routed]) -> BatchOutput:
        out = BatchOutput()
        started = datetime.now(UTC)
        runnable: list[tuple[Routed, str | None, str]] = []
        failed_loads: dict[str, EngineError] = {}
        for item in items:
            a = item.route.adapter
            label = item.route.label
            if a is not None and a.key not in failed_loads and not self.engine.has_adapter(a.key):
                try:
                    info = self.engine.load_adapter(a.key, self.store.path(a.sha256))
                except (AdapterError, OSError) as e:
                    err = e if isinstance(e, EngineError) else AdapterError(f"cannot read adapter files: {e}", code="adapter_unavailable")
                    failed_loads[a.key] = err
                    log.error("adapter %s failed to load: %s", a.key, err)
                else:
                    out.loads.append(AdapterLoadRecord(
                        adapter=a.ref, adapter_sha256=a.sha256, tenant_id=a.tenant_id, tier=info.tier,
                        nbytes=info.nbytes, load_us=info.load_us, worker_id=self.worker_id, created_at=datetime.now(UTC)))
            if a is not None and a.key in failed_loads:
                err = failed_loads[a.key]
                out.adapter_ok.append((a.key, False))
                if item.job.allow_base_fallback:
                    runnable.append((item, None, f"base_fallback ({a.ref} failed to load)"))
                    continue
                info = ErrorInfo(code=err.code, message=f"adapter {a.ref} could not be loaded: {err.message}",
                                 field="adapter", retriable=err.retriable)
                result, usage = failed_before_engine(
                    (item.job.request_id, item.job.tenant_id, item.job.batch_id), info, item.received_at,
                    self.worker_id, route_reason=label, routing_us=item.route.decision_us)
                out.outcomes.append(Outcome(item.tp, item.offset, result=result, usage=usage))
                continue
            runnable.append((item, a.key if a else None, label))
        if runnable:
            results = self._generate(runnable)
            for (item, key, label), res in zip(runnable, results):
                a = item.route.adapter if key is not None else None
                if a is not None:
                    out.adapter_ok.append((a.key, res.error is None or res.error.code in _CALLER_ERRORS))
                served = Served(item.job, a.ref if a else None, a.sha256 if a else None, label,
                                item.route.decision_us, item.received_at)
                result, usage = succeeded_or_failed(served, res, self.worker_id)
                out.outcomes.append(Outcome(item.tp, item.offset, result=result, usage=usage))
        steps = self.engine.pop_step_records()
        if steps:
            out.busy = BusyRecord(worker_id=self.worker_id, gpu_kind=self.gpu_kind, started_at=started,
                                  ended_at=datetime.now(UTC), busy_us=sum(r.total_us for r in steps), steps=len(steps))
        return out

    def _generate(self, runnable: list[tuple[Routed, str | None, str]]) -> list[GenerationResult]:
        requests = [to_request(item.job, key, item.received_mono_us) for item, key, _ in runnable]
        try:
            return self.engine.generate(requests)
        except Exception:
            if len(requests) == 1:
                log.exception("engine failed on request %s", requests[0].request_id)
                return [GenerationResult(request_id=requests[0].request_id, adapter=requests[0].adapter,
                                         error=EngineError("the engine failed on this request; it was logged",
                                                           code="engine_error", retriable=True))]
            log.exception("engine failed on a batch of %d; running its requests one by one", len(requests))
            return [self._generate([r])[0] for r in runnable]


# Failures that are the caller's doing, not the adapter's: they do not count against its circuit.
_CALLER_ERRORS = frozenset({"prompt_too_long", "max_new_tokens_too_large", "empty_prompt", "invalid_input_ids",
                            "invalid_request", "invalid_sampling_params", "invalid_messages", "aborted"})
