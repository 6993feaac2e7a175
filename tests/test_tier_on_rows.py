"""Each request's tokens are priced at the tier its tenant had when it ran, not at the tenant's tier at invoice time.

Runs on SQLite and the machine's PostgreSQL. Token prices per million (input / output), from 2026-03-01:
standard 1.00 / 2.00, premium 10.00 / 20.00; tier "batch" has none. March 2026, tenant acme:

    s1  standard  1_000_000 in    500_000 out     1.00 +  1.00 =  2.00
    s2  standard    250_000 in    250_000 out     0.25 +  0.50 =  0.75
    -- acme moves to premium on the 20th --
    p1  premium   1_000_000 in  1_000_000 out    10.00 + 20.00 = 30.00      revenue 32.75

Priced at the tier at invoice time (before this version) the draft earned 10 + 10 + 2.5 + 5 + 30 = 57.50.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
from datetime import date, datetime, timezone
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from sqlalchemy import Engine, inspect, select, text, update
from sqlalchemy.orm import Session

from billing import db
from billing.closing import close_period
from billing.config import LedgerConfig
from billing.errors import LedgerRecordError
from billing.invoice import build_invoice
from billing.invoice_render import render_csv, render_json, render_table
from billing.ledger import Ledger
from billing.models import Tenant, Usage
from billing.prices import set_token_price
from consumer.config import Settings
from consumer.feeder import EngineFeeder
from consumer.intake import Intake
from consumer.metrics import WorkerMetrics
from consumer.registry import RegistrySnapshot
from consumer.routing import Route
from consumer.schemas import ErrorInfo, Job
from consumer.spool import Spool, _decode, _encode
from consumer.tenants import TenantView
from engine.api import GenerationRequest, GenerationResult, RequestTimings
from migrations import SCRIPT_LOCATION
from tests.test_ledger import usage_record
from tests.test_unbilled_work import _StubEngine

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("3.60"))
MARCH_2, MARCH_25 = datetime(2026, 3, 2, 12, tzinfo=timezone.utc), datetime(2026, 3, 25, 12, tzinfo=timezone.utc)
APRIL_2 = datetime(2026, 4, 2, tzinfo=timezone.utc)
M = 1_000_000


def _prices(engine: Engine) -> None:
    set_token_price(engine, "standard", Decimal("1.00"), Decimal("2.00"), date(2026, 3, 1), currency="USD")
    set_token_price(engine, "premium", Decimal("10.00"), Decimal("20.00"), date(2026, 3, 1), currency="USD")


def _set_tier(engine: Engine, tier: str) -> None:
    with Session(engine) as session, session.begin():
        if session.get(Tenant, "acme") is None:
            session.add(Tenant(id="acme", display_name="Acme", tier=tier))
        else:
            session.execute(update(Tenant).where(Tenant.id == "acme").values(tier=tier))


def _ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url)))


def _month_with_a_tier_change(engine: Engine) -> Ledger:
    """The month of the module docstring, written as the worker writes it: each row with the tier it routed with."""
    _prices(engine)
    ledger = _ledger(engine)
    _set_tier(engine, "standard")
    ledger.record_usage([usage_record("s1", created_at=MARCH_2, input_tokens=M, output_tokens=M // 2, tier="standard"),
                         usage_record("s2", created_at=MARCH_2, input_tokens=M // 4, output_tokens=M // 4, tier="standard")])
    _set_tier(engine, "premium")
    ledger.record_usage([usage_record("p1", created_at=MARCH_25, input_tokens=M, output_tokens=M, tier="premium")])
    return ledger


def test_each_request_is_priced_at_the_tier_it_ran_at(engine: Engine) -> None:
    """Revenue is each row's tokens at its own tier's price (32.75 by hand), where the tier at invoice time gave 57.50;
    the invoice names both tiers it billed."""
    _month_with_a_tier_change(engine)
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    assert invoice.totals.revenue == Decimal("32.750000000")
    assert (invoice.tier, invoice.tiers_billed, invoice.unpriced_requests) == ("premium", ("premium", "standard"), 0)
    assert "note: tokens priced at tiers 'premium', 'standard': each request at the tier its tenant had when it ran" in render_table(invoice)
    # The JSON and CSV carry the tiers as the table names them (test_json_and_csv_say_what_the_table_says).
    assert json.loads(render_json(invoice))["tiers_billed"] == ["premium", "standard"]


def test_a_redraft_after_another_tier_change_reprices_nothing(engine: Engine) -> None:
    """A tier change after the requests ran changes no past row's price: the re-drafted invoice is the same, in every
    format, even when the new tier has no token price at all."""
    _month_with_a_tier_change(engine)
    before = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    for tier in ("standard", "batch", "premium"):
        _set_tier(engine, tier)
        again = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
        assert (render_json(again), render_csv(again), again.tiers_billed) == (render_json(before), render_csv(before), before.tiers_billed)


def test_a_closed_invoice_names_the_tiers_it_billed_after_a_tier_change(engine: Engine) -> None:
    """Closed, the invoice keeps its revenue and the tiers it billed whatever the registry says later."""
    _month_with_a_tier_change(engine)
    (closed,) = close_period(engine, CONFIG, "2026-03", now=APRIL_2)
    assert (closed.totals.revenue, closed.tiers_billed) == (Decimal("32.750000000"), ("premium", "standard"))
    _set_tier(engine, "batch")
    again = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    assert render_table(again) == render_table(closed) and again.tier == "premium"


def test_json_and_csv_say_what_the_table_says(engine: Engine) -> None:
    """Finance's machine-readable invoice carries what the table's title and notes say: when the invoice was closed
    (null / empty for a draft) and the tiers its tokens were priced at. The CSV keeps its columns in their order and
    appends these two, on every row."""
    _month_with_a_tier_change(engine)
    draft = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    (closed,) = close_period(engine, CONFIG, "2026-03", now=APRIL_2)
    assert "(closed 2026-04-02T00:00:00Z)" in render_table(closed).splitlines()[0]
    for invoice, closed_at in ((draft, None), (closed, "2026-04-02T00:00:00Z")):
        document = json.loads(render_json(invoice))
        assert (document["closed_at"], document["tiers_billed"]) == (closed_at, ["premium", "standard"])
        header, *rows = list(csv.reader(io.StringIO(render_csv(invoice))))
        assert header == ["tenant", "period", "status", "currency", "adapter", "adjustment_for", "gpu_price_per_hour",
                          "requests", "failed", "input_tokens", "output_tokens", "cached_tokens", "base_ms", "lora_ms",
                          "routing_ms", "kv_saved_ms", "cold_start_ms", "gpu_ms", "cost", "revenue", "unpriced_requests",
                          "closed_at", "tiers_billed"]  # fmt: skip
        assert rows and all(row[-2:] == [closed_at or "", '["premium", "standard"]'] for row in rows), rows
        assert json.loads(rows[-1][-1]) == list(invoice.tiers_billed)


def test_a_tenant_with_nothing_in_a_closed_month_has_the_months_closed_at(engine: Engine) -> None:
    """A tenant the registry knows that billed nothing in a month closed with --close-period gets an empty closed
    invoice: its json and csv say when it was closed (the month's close), as every closed invoice's do, not null as a
    draft's."""
    _month_with_a_tier_change(engine)
    with Session(engine) as session, session.begin():
        session.add(Tenant(id="globex", display_name="Globex", tier="standard"))
    close_period(engine, CONFIG, "2026-03", now=APRIL_2)
    empty = build_invoice(engine, "globex", "2026-03", CONFIG, now=APRIL_2)
    assert (empty.status, empty.totals.requests) == ("closed", 0)
    assert json.loads(render_json(empty))["closed_at"] == "2026-04-02T00:00:00Z"
    assert all(row["closed_at"] == "2026-04-02T00:00:00Z" for row in csv.DictReader(io.StringIO(render_csv(empty))))
    assert "(closed 2026-04-02T00:00:00Z)" in render_table(empty).splitlines()[0]


def test_rows_without_a_tier_are_priced_at_the_tenants_tier_now(engine: Engine) -> None:
    """A row that records no tier (written before revision 0010) is priced at the tenant's tier at invoice time, as
    every row was before; the rows that record one keep theirs. Succeeded requests of a tier with no price are counted
    unpriced per group: failed ones are not, and other groups still earn."""
    _prices(engine)
    _set_tier(engine, "premium")
    _ledger(engine).record_usage([
        usage_record("old", created_at=MARCH_2, input_tokens=M, output_tokens=0),  # tier None: premium now, 10.00
        usage_record("s1", created_at=MARCH_2, input_tokens=M, output_tokens=0, tier="standard"),  # 1.00
        usage_record("b1", created_at=MARCH_2, input_tokens=M, output_tokens=M, tier="batch"),  # no price: unpriced
        usage_record("b2", created_at=MARCH_2, input_tokens=M, status="failed", error_code="oom", tier="batch"),  # failed: neither
    ])
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    assert (invoice.totals.revenue, invoice.unpriced_requests) == (Decimal("11.000000000"), 1)
    assert invoice.tiers_billed == ("batch", "premium", "standard")
    assert "1 succeeded requests earned nothing: one of tiers 'batch', 'premium', 'standard' had no token price" in render_table(invoice)
    _set_tier(engine, "standard")  # the untiered row alone follows the registry: 1.00 where it was 10.00
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    assert (invoice.totals.revenue, invoice.tiers_billed) == (Decimal("2.000000000"), ("batch", "standard"))


def test_one_tier_says_nothing_new(engine: Engine) -> None:
    """An invoice of one tier renders as before: no note, and the unpriced note names that tier."""
    _set_tier(engine, "batch")
    _ledger(engine).record_usage([usage_record("b1", created_at=MARCH_2, input_tokens=5, tier="batch")])
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2)
    text_ = render_table(invoice)
    assert invoice.tiers_billed == ("batch",) and "tokens priced at tiers" not in text_
    assert "1 succeeded requests earned nothing: tier 'batch' had no token price then" in text_


@pytest.mark.parametrize("tier", ["", " ", " premium", "premium\n", "x" * 33])
def test_a_tier_that_names_no_price_list_is_refused(engine: Engine, tier: str) -> None:
    """A blank, padded or over-long tier is refused naming the field, and nothing of its batch is written."""
    with pytest.raises(LedgerRecordError, match="tier="):
        _ledger(engine).record_usage([usage_record("ok", tier="standard"), usage_record("bad", tier=tier)])
    with Session(engine) as session:
        assert session.scalar(select(Usage.id)) is None


def test_a_record_spooled_without_a_tier_still_lands(engine: Engine, tmp_path: Path) -> None:
    """A usage record spooled by the version before (its body has no tier) reads back with none and is written with
    NULL, priced at the tenant's tier; one spooled with a tier keeps it."""
    _prices(engine)
    _set_tier(engine, "standard")
    spool = Spool(tmp_path / "spool.sqlite", max_records=10)
    try:
        body = json.loads(_encode(usage_record("old", created_at=MARCH_2, input_tokens=M)))
        del body["tier"]
        spool.put([_decode("usage", json.dumps(body)), usage_record("new", created_at=MARCH_2, input_tokens=M, tier="premium")])
        kind, ids, records = spool.oldest(10)
        assert (kind, [r.tier for r in records]) == ("usage", [None, "premium"])
        assert _ledger(engine).record_usage(records) == 2
        spool.remove(ids)
    finally:
        spool.close()
    with Session(engine) as session:
        assert {r: t for r, t in session.execute(select(Usage.request_id, Usage.tier))} == {"old": None, "new": "premium"}
    assert build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2).totals.revenue == Decimal("11.000000000")


def test_0010_adds_tier_and_keeps_old_rows(db_url: str) -> None:
    """0010 adds usage.tier, NULL on the rows already there (priced at the tenant's tier now); the downgrade drops it and
    keeps every row."""
    db.upgrade(db_url, "0009", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    usage = ("INSERT INTO usage (tenant_id, request_id, status, route_reason, input_tokens, output_tokens, cached_tokens, base_us, lora_us, "
             "routing_us, kv_saved_us, queue_us, ttft_us, total_us, cost, period, invoice_period, created_at, worker_id) VALUES "
             "('acme', 'old', 'succeeded', '', 1000000, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, '2026-03', '2026-03', '2026-03-02 10:00:00+00', 'w0')")
    try:
        with engine.begin() as connection:
            connection.execute(text(usage))
        db.upgrade(db_url, "0010", script_location=SCRIPT_LOCATION)
        engine.dispose()
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id, tier FROM usage")).all() == [("old", None)]
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)  # the prices below are written as this code writes them
        engine.dispose()
        _prices(engine)
        _set_tier(engine, "premium")
        _ledger(engine).record_usage([usage_record("new", created_at=MARCH_2, input_tokens=M, tier="standard")])
        assert build_invoice(engine, "acme", "2026-03", CONFIG, now=APRIL_2).totals.revenue == Decimal("11.000000000")
        db.downgrade(db_url, "0009", script_location=SCRIPT_LOCATION)
        engine.dispose()  # SQLite's batch mode rebuilt the table under the pooled connections
        assert "tier" not in {c["name"] for c in inspect(engine).get_columns("usage")}
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id FROM usage ORDER BY request_id")).scalars().all() == ["new", "old"]
    finally:
        engine.dispose()


class _Engine(_StubEngine):
    async def generate(self, req: GenerationRequest) -> GenerationResult:
        return GenerationResult(request_id=req.request_id, adapter_key=None, tenant_id=req.tenant_id, output_ids=[7], prompt_tokens=2,
                                finish_reason="length", timings=RequestTimings(base_us=700))


def _snapshot(**tiers: str) -> RegistrySnapshot:
    return RegistrySnapshot({t: TenantView(t, t, tier, 1) for t, tier in tiers.items()}, {}, {}, ())


async def test_the_worker_writes_the_tier_of_the_snapshot_it_routed_with() -> None:
    """The row of a routed job carries its tenant's tier in the snapshot it was routed with, even when the registry
    changed before it ran; a job failed before the engine carries the snapshot's tier too; an unregistered tenant's
    record (when one is written) has none."""
    pushed: list = []
    routes = SimpleNamespace(route_batch=lambda snap, classifier, jobs: asyncio.sleep(0, [Route(None, "base", 5) for _ in jobs]))
    scheduler = SimpleNamespace(push=pushed.append, over_quota=lambda tenant, tokens: False)
    intake = Intake(Settings(), WorkerMetrics(), "w1", scheduler, routes, None, None, asyncio.Event(), _snapshot(acme="standard"))
    emitted: list = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)
    tp = TopicPartition("jobs", 0)
    await intake.admit([(tp, 0, 0, Job(request_id="r1", tenant_id="acme", input_ids=[1, 2], max_new_tokens=2))], MARCH_2)
    (pending,) = pushed
    intake.use(_snapshot(acme="premium"))  # a registry reload between routing and serving
    served = await EngineFeeder(_Engine(), store=None, worker_id="w1", gpu_kind="h100").serve(pending.payload, "standard")
    assert served.outcome.usage.tier == "standard"
    job = Job(request_id="r2", tenant_id="acme", input_ids=[1], max_new_tokens=1)
    intake.running[("acme", "r2")] = []
    intake.fail(tp, 1, 0, job, ErrorInfo(code="unknown_adapter", message="no such adapter"), MARCH_2, "explicit")
    assert emitted[-1].usage.tier == "premium"
    assert intake.tier_of("nobody") is None and intake.tier_of(None) is None
