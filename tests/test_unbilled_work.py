"""Unbilled work: busy time that requests took which no usage row bills is named on a busy record (gpu_busy.unbilled_us,
revision 0007) and shown by reconcile as unbilled work, not as unexplained busy time.

Where it comes from: an engine process that dies (tests/test_worker_engine_process.py runs that end to end), a job
abandoned when its partition is revoked, and a result that reaches no caller (its generate was cancelled).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

import pytest
from sqlalchemy import Engine

from billing.config import LedgerConfig
from billing.errors import LedgerRecordError
from billing.ledger import Ledger
from billing.reconcile import reconcile_report
from billing.records import BusyRecord
from consumer.feeder import EngineFeeder
from consumer.schemas import Job
from consumer.spool import _decode
from engine.api import GenerationRequest, GenerationResult, RequestTimings, SamplingParams
from engine.async_engine import AsyncEngine, charged_us
from engine.config import EngineConfig
from engine.engine import Engine as LlmEngine
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"))
OCT = datetime(2026, 10, 5, 12, tzinfo=UTC)
NOW = datetime(2026, 12, 1, tzinfo=UTC)


def test_reconcile_names_unbilled_work_and_leaves_nothing_unexplained(engine: Engine) -> None:
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    ledger.record_usage([usage_record("r1", created_at=OCT, worker_id="w0", base_us=1_000, lora_us=200)])
    # 1,500 µs busy: r1's 1,200 and 300 of a request the engine crash failed (named on the next record, after the restart)
    ledger.record_busy([BusyRecord("w0", "h100", OCT, OCT + timedelta(seconds=1), 1_500, 3),
                        BusyRecord("w0", "h100", OCT + timedelta(seconds=1), OCT + timedelta(seconds=1, microseconds=1), 0, 0, unbilled_us=300)])
    report = reconcile_report(engine, "2026-10", CONFIG, now=NOW)
    assert (report.us("gpu_busy"), report.us("unbilled_work"), report.us("unexplained_busy")) == (1_500, 300, 0)
    assert report.conserved


@pytest.mark.parametrize("bad", [-1, 1.5, None])
def test_a_bad_unbilled_figure_is_refused_by_name(engine: Engine, bad) -> None:
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    with pytest.raises(LedgerRecordError, match="unbilled_us"):
        ledger.record_busy([BusyRecord("w0", "h100", OCT, OCT + timedelta(seconds=1), 10, 1, unbilled_us=bad)])


def test_a_busy_record_spooled_before_revision_0007_reads_back_with_nothing_unbilled() -> None:
    body = json.dumps({"worker_id": "w0", "gpu_kind": "h100", "started_at": OCT.isoformat(),
                       "ended_at": (OCT + timedelta(seconds=1)).isoformat(), "busy_us": 10, "steps": 1})
    assert _decode("busy", body).unbilled_us == 0


class _StubEngine:
    """What EngineFeeder needs of an engine host: generate answers at once; pop_gpu_time hands out what the test set."""

    def __init__(self):
        self.gpu = ([], 0, 0, datetime.now(UTC), 0)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        return GenerationResult(request_id=req.request_id, adapter_key=None, tenant_id=req.tenant_id, output_ids=[7],
                                finish_reason="aborted", timings=RequestTimings(base_us=700, lora_us=50))

    async def pop_gpu_time(self):
        return self.gpu


async def test_a_job_abandoned_on_a_revoke_is_named_unbilled_on_the_next_busy_record() -> None:
    stub = _StubEngine()
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100")
    job = Job(request_id="r1", tenant_id="acme", input_ids=[1, 2], max_new_tokens=4)
    item = SimpleNamespace(job=job, route=SimpleNamespace(view=None, label="base", routing_us=0), stamps=None, abandoned=True,
                           received_mono_us=0)
    served = await feeder.serve(item, "standard")
    assert served.outcome is None, "an abandoned job has no result and no usage row here"
    t0 = feeder._since
    # No step since the last record, only the abandoned job's time: a record of its own, 1 µs on, so that the key
    # (worker_id, started_at) of the next one stays unique.
    stub.gpu = ([], 0, 0, t0, 0)
    _, busy = await feeder.drain_gpu_time()
    assert busy is not None and (busy.busy_us, busy.steps, busy.unbilled_us) == (0, 0, 750)
    assert busy.started_at == t0 and busy.ended_at == t0 + timedelta(microseconds=1)
    stub.gpu = ([], 2_000, 4, t0 + timedelta(seconds=1), 25)  # the engine host's own (a result nobody awaited)
    _, later = await feeder.drain_gpu_time()
    assert later.started_at == busy.ended_at and (later.busy_us, later.unbilled_us) == (2_000, 25)
    stub.gpu = ([], 0, 0, later.ended_at, 0)
    assert (await feeder.drain_gpu_time())[1] is None, "nothing measured and nothing unbilled: no record"


async def test_a_record_whose_steps_pass_its_span_ends_later(engine: Engine) -> None:
    """An engine process pops its steps without reading back the decode round it leaves running (the GPU carries on),
    so a round may have begun a read-back's host time before the clock it reports: a record's steps can pass its wall
    span. Such a record ends that much later and the next starts there: every record fits its span (the ledger refuses
    one that does not), the records stay contiguous, and every µs is on the record that measured it."""
    stub = _StubEngine()
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100")
    t0 = feeder._since
    stub.gpu = ([], 1_000_300, 9, t0 + timedelta(seconds=1), 0)  # 300 µs of the next round's head start
    _, first = await feeder.drain_gpu_time()
    assert (first.busy_us, first.steps) == (1_000_300, 9) and first.ended_at == t0 + timedelta(seconds=1, microseconds=300)
    stub.gpu = ([], 400_000, 4, t0 + timedelta(seconds=2), 0)
    _, second = await feeder.drain_gpu_time()
    assert second.started_at == first.ended_at and second.ended_at == t0 + timedelta(seconds=2) and second.busy_us == 400_000
    stub.gpu = ([], 1_000_000, 8, t0 + timedelta(seconds=2, microseconds=999_990), 0)  # the clock behind the steps again
    _, third = await feeder.drain_gpu_time()
    assert third.ended_at == second.ended_at + timedelta(seconds=1)
    stub.gpu = ([], 0, 1, t0 + timedelta(seconds=2, microseconds=999_995), 0)  # a step of 0 µs (a forward that failed)
    _, fourth = await feeder.drain_gpu_time()
    assert fourth.started_at == third.ended_at and fourth.ended_at == third.ended_at + timedelta(microseconds=1)
    stub.gpu = ([], 500, 1, t0 + timedelta(seconds=4), 0)
    _, fifth = await feeder.drain_gpu_time()
    assert fifth.started_at == fourth.ended_at  # keys (worker_id, started_at) all differ: none dropped as a duplicate
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    records = [first, second, third, fourth, fifth]
    ledger.record_busy(records)  # each within its span: accepted
    report = reconcile_report(engine, f"{t0:%Y-%m}", CONFIG, now=t0 + timedelta(days=40))
    assert report.us("gpu_busy") == sum(r.busy_us for r in records) == 1_000_300 + 400_000 + 1_000_000 + 500


async def test_a_result_that_reaches_no_caller_is_unbilled(demo_set) -> None:
    """A generate cancelled while its request runs: the engine aborts it and its partial result reaches nobody; the
    steps' busy time equals what the delivered results carry plus the unbilled µs."""
    eng = LlmEngine(EngineConfig(model_dir=str(demo_set["model"]), device="cpu", max_new_tokens=64, max_prompt_tokens=64))
    async with AsyncEngine(eng) as ae:
        await ae.pop_gpu_time()
        sp = SamplingParams(max_new_tokens=24, ignore_eos=True)
        kept = [asyncio.create_task(ae.generate(GenerationRequest(request_id=f"k{i}", input_ids=(3, 4, 5 + i), sampling=sp)))
                for i in range(2)]
        gone = asyncio.create_task(ae.generate(GenerationRequest(request_id="gone", input_ids=(3, 9, 9), sampling=sp)))
        while (await ae.stats())["steps"] < 3:
            await asyncio.sleep(0.005)
        gone.cancel()
        results = await asyncio.gather(*kept)
        await asyncio.sleep(0.05)  # the abort's result settles on this loop
        _, busy_us, steps, _, unbilled = await ae.pop_gpu_time()
    assert gone.cancelled() and all(r.ok for r in results)
    assert unbilled > 0 and busy_us == sum(charged_us(r) for r in results) + unbilled, (busy_us, unbilled)
