"""The auditor's checks as one property over random months, against the ledger's own rows (issue 16).

A month of October 2026 work: engine batches split by the engine's own attribute_step (engine/timing.py),
requests with cached tokens and measured KV savings from none to absurd (the 846 ms credited on a 46 ms
charge), adapter loads, identical re-sent writes and real reruns on other workers, some invoices closed
(one tenant's, or the whole month), then late usage and everything delivered again. Invariants:

  no_negative_line     every line's and total's gpu_ms and cost >= 0, October's and November's
  credit_le_charge     every row's credit <= its base + LoRA; every line's kv_saved_ms <= base_ms + lora_ms
  formats_equal        each invoice's table, json and csv read back to the same rows; each report's
                       (finance, sre, reconcile) table, json, csv and html to the same summary and rows
  residue_explained    reconcile: busy = base + lora + billed_later + redelivered, nothing unexplained,
                       invoices = their rows, loads = spread + unused, for October and November
  drafts_stable        re-sending every write and rerunning requests leaves the drafts byte-identical
  closed_identical     closed invoices render byte-identical (table, json, csv) after late usage and redelivery

The counts of cases and of invariants checked are printed at the end of the module (run with -s).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select, text
from sqlalchemy.orm import Session

from billing import db
from billing.closing import close_invoice, close_period
from billing.config import LedgerConfig
from billing.credit import kv_credit_sql
from billing.finance import finance_report
from billing.invoice import Invoice, period_invoices
from billing.invoice_render import render_csv, render_json, render_table
from billing.ledger import Ledger
from billing.models import Base, Usage
from billing.prices import set_token_price
from billing.reconcile import reconcile_report
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from billing.report_render import FORMATS, render_report
from billing.sre import sre_report
from engine.timing import attribute_step
from migrations import SCRIPT_LOCATION
from tests.report_formats import INVOICE_READERS, READERS

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"))
OCT = datetime(2026, 10, 1, tzinfo=timezone.utc)
NOV_2 = datetime(2026, 11, 2, tzinfo=timezone.utc)
NOW = datetime(2026, 12, 1, tzinfo=timezone.utc)
TENANTS = ("t0", "t1", "t2")  # t2 is not registered: known to the ledger only
ADAPTERS = {"x@1": "11" * 32, "y@1": "22" * 32, "z@1": "33" * 32}  # z@1 may be loaded and never used
TABLES = ("invoice_lines", "invoices", "cold_start_shares", "billing_periods", "gpu_busy", "adapter_loads", "usage", "usage_redeliveries",
          "token_prices", "tenants")
TALLY: Counter[str] = Counter()


@dataclass(frozen=True)
class Month:
    usage: list[UsageRecord]
    busy: list[BusyRecord]
    loads: list[AdapterLoadRecord]
    reruns: list[tuple[list[UsageRecord], BusyRecord]]  # second runs of some requests, with the busy time they took
    late: tuple[list[UsageRecord], BusyRecord] | None  # October work that reaches the ledger after the closes
    closes: str  # "none" | "one" (t0's invoice) | "period"
    seed: int


def _batch(draw: st.DrawFn, ids: list[str], start: datetime, worker: str, tenant_of: dict[str, str],
           adapter_of: dict[str, str | None]) -> tuple[list[UsageRecord], BusyRecord]:
    """One engine batch over `ids`: steps split by the engine, then one usage row per request and the batch's busy record."""
    times: dict[str, list[int]] = {}
    total = 0
    steps = draw(st.integers(1, 4))
    for i in range(steps):
        present = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
        rows = [((tenant_of[rid], rid), draw(st.integers(1, 64)), adapter_of[rid] is not None) for rid in present]
        step_us = draw(st.integers(0, 10**6))
        lora_us = draw(st.integers(0, step_us)) if any(lora for *_, lora in rows) else 0
        for share in attribute_step(i, step_us, lora_us, rows).shares:
            t = times.setdefault(share.request_id, [0, 0, 0])
            t[0] += share.base_us
            t[1] += share.lora_us
            t[2] += share.tokens
        total += step_us
    usage = []
    for rid, (base_us, lora_us, tokens) in sorted(times.items()):
        cached = draw(st.integers(0, 4 * tokens))
        usage.append(UsageRecord(
            tenant_id=tenant_of[rid], request_id=rid, status=draw(st.sampled_from(["succeeded", "succeeded", "failed"])), created_at=start,
            adapter=adapter_of[rid], adapter_sha256=ADAPTERS.get(adapter_of[rid] or ""), input_tokens=tokens + cached, cached_tokens=cached,
            output_tokens=draw(st.integers(0, 8)), base_us=base_us, lora_us=lora_us, routing_us=draw(st.integers(0, 500)),
            kv_saved_us=draw(st.one_of(st.just(0), st.integers(0, 10**4), st.integers(0, 10**8))), worker_id=worker,
        ))
    return usage, BusyRecord(worker, "h100", start, start + timedelta(microseconds=total + 1_000), total, steps)


@st.composite
def months(draw: st.DrawFn) -> Month:
    usage: list[UsageRecord] = []
    busy: list[BusyRecord] = []
    tenant_of: dict[str, str] = {}
    adapter_of: dict[str, str | None] = {}
    for b in range(draw(st.integers(1, 3))):
        ids = [f"r{b}-{i}" for i in range(draw(st.integers(1, 5)))]
        tenant_of |= {rid: draw(st.sampled_from(TENANTS)) for rid in ids}
        adapter_of |= {rid: draw(st.sampled_from([None, "x@1", "y@1"])) for rid in ids}
        batch_usage, record = _batch(draw, ids, OCT + timedelta(days=draw(st.integers(0, 29)), seconds=b), f"w{b % 2}", tenant_of, adapter_of)
        usage += batch_usage
        busy.append(record)
    reruns = []
    for k, again in enumerate(draw(st.lists(st.sampled_from([u.request_id for u in usage]), max_size=3, unique=True))):
        rerun_usage, record = _batch(draw, [again], OCT + timedelta(days=draw(st.integers(0, 29)), hours=k + 1), "w9", tenant_of, adapter_of)
        reruns.append((rerun_usage, record))
    loads = [
        AdapterLoadRecord(adapter, ADAPTERS[adapter], "platform", "disk", 1, draw(st.integers(0, 10**6)), f"w{i % 2}", OCT + timedelta(hours=i))
        for i, adapter in enumerate(draw(st.lists(st.sampled_from(sorted(ADAPTERS)), max_size=4)))
    ]
    late = None
    if draw(st.booleans()):
        ids = [f"late-{i}" for i in range(draw(st.integers(1, 3)))]
        tenant_of |= {rid: draw(st.sampled_from(TENANTS)) for rid in ids}
        adapter_of |= {rid: draw(st.sampled_from([None, "x@1"])) for rid in ids}
        late = _batch(draw, ids, OCT + timedelta(days=30, hours=23), "w5", tenant_of, adapter_of)
    return Month(usage, busy, loads, reruns, late, draw(st.sampled_from(["none", "one", "period"])), draw(st.integers(0, 2**32)))


def _fresh(engine: Engine) -> Ledger:
    with engine.begin() as connection:
        for name in TABLES:
            connection.execute(delete(Base.metadata.tables[name]))
        connection.execute(text("INSERT INTO tenants (id, display_name, tier) VALUES ('t0', 'T0', 'standard'), ('t1', 'T1', 'premium')"))
    set_token_price(engine, "standard", Decimal("0.20"), Decimal("0.60"), date(2026, 1, 1), currency="USD")
    set_token_price(engine, "premium", Decimal("0.50"), Decimal("1.50"), date(2026, 1, 1), currency="USD")
    return Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))


def _deliver(ledger: Ledger, month: Month, rng: random.Random) -> None:
    """Every write at least once: shuffled, in chunks, some re-sent as they were; each rerun with the busy time it took."""
    usage = month.usage + rng.sample(month.usage, k=rng.randint(0, len(month.usage)))
    rng.shuffle(usage)
    cut = rng.randint(0, len(usage))
    ledger.record_usage(usage[:cut])
    ledger.record_busy(month.busy + month.busy[: rng.randint(0, len(month.busy))])
    ledger.record_usage(usage[cut:])
    ledger.record_adapter_loads(month.loads + month.loads[: rng.randint(0, len(month.loads))])


def _rerun(ledger: Ledger, month: Month) -> None:
    for rerun_usage, record in month.reruns:
        ledger.record_usage(rerun_usage)
        ledger.record_busy([record])


def _renders(invoices: list[Invoice]) -> list[tuple[str, str, str]]:
    return [(render_table(i), render_json(i), render_csv(i)) for i in invoices]


def _check_invoices(engine: Engine, invoices: list[Invoice]) -> None:
    for invoice in invoices:
        for amounts in (*invoice.lines, invoice.totals):
            assert amounts.gpu_ms >= 0 and amounts.cost >= 0, (invoice.tenant, amounts)
            assert amounts.kv_saved_ms <= amounts.base_ms + amounts.lora_ms, (invoice.tenant, amounts)
        TALLY["no_negative_line"] += 1
        TALLY["credit_le_charge"] += 1
        table, document, sheet = _renders([invoice])[0]
        rows = INVOICE_READERS["json"](document)
        assert INVOICE_READERS["table"](table) == rows and INVOICE_READERS["csv"](sheet) == rows, invoice.tenant
        TALLY["formats_equal"] += 1
    with Session(engine) as session:
        worst = session.execute(select(Usage.request_id, kv_credit_sql(), Usage.base_us + Usage.lora_us)).all()
    assert all(credit <= charge for _, credit, charge in worst)


def _check_reports(engine: Engine, period: str) -> None:
    for report in (finance_report(engine, period, CONFIG, now=NOW), sre_report(engine, period, now=NOW), reconcile_report(engine, period, CONFIG, now=NOW)):
        forms = {fmt: READERS[fmt](render_report(report, fmt)) for fmt in FORMATS}
        assert all(forms[fmt] == forms["json"] for fmt in FORMATS), type(report).__name__
        TALLY["formats_equal"] += 1
    for t in finance_report(engine, period, CONFIG, now=NOW).tenants:
        assert 0 <= t.gpu_share <= 1 and 0 <= t.revenue_share <= 1, t


def _check_reconcile(engine: Engine, period: str, redelivered_us: int) -> None:
    r = reconcile_report(engine, period, CONFIG, now=NOW)
    assert r.conserved and r.us("unexplained_busy") == 0 and r.us("invoice_difference") == 0, r
    assert r.us("gpu_busy") == r.us("base") + r.us("lora") + r.us("billed_later") + r.us("redelivered_work")
    assert r.us("adapter_loads") == r.us("cold_start_spread") + r.us("unused_loads")
    assert r.us("redelivered_work") == redelivered_us
    TALLY["residue_explained"] += 1


def _property(engine: Engine, month: Month) -> None:
    ledger = _fresh(engine)
    rng = random.Random(month.seed)
    _deliver(ledger, month, rng)
    drafts = _renders(period_invoices(engine, "2026-10", CONFIG, now=NOW))
    _rerun(ledger, month)
    _deliver(ledger, month, rng)
    assert _renders(period_invoices(engine, "2026-10", CONFIG, now=NOW)) == drafts
    TALLY["drafts_stable"] += 1
    redelivered = sum(u.base_us + u.lora_us for rerun_usage, _ in month.reruns for u in rerun_usage)
    _check_invoices(engine, period_invoices(engine, "2026-10", CONFIG, now=NOW))
    _check_reports(engine, "2026-10")
    _check_reconcile(engine, "2026-10", redelivered)

    if month.closes == "one":
        close_invoice(engine, CONFIG, "t0", "2026-10", now=NOV_2)
    elif month.closes == "period":
        close_period(engine, CONFIG, "2026-10", now=NOV_2)
    closed = [i for i in period_invoices(engine, "2026-10", CONFIG, now=NOW) if i.status == "closed"]
    frozen = _renders(closed)

    if month.late is not None:
        late_usage, late_busy = month.late
        ledger.record_usage(late_usage)
        ledger.record_busy([late_busy])
    _deliver(ledger, month, rng)
    _rerun(ledger, month)
    assert _renders([i for i in period_invoices(engine, "2026-10", CONFIG, now=NOW) if i.status == "closed"]) == frozen
    TALLY["closed_identical"] += 1
    for period in ("2026-10", "2026-11"):
        _check_invoices(engine, period_invoices(engine, period, CONFIG, now=NOW))
        _check_reports(engine, period)
        _check_reconcile(engine, period, redelivered if period == "2026-10" else 0)
    TALLY["cases"] += 1


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}


@pytest.fixture(scope="module", autouse=True)
def _report_tally() -> Iterator[None]:
    yield
    print(f"\naudit property: {TALLY['cases']} cases; invariants held: " + ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items()) if k != "cases"))


@settings(max_examples=8, **_SETTINGS)
@given(month=months())
def test_audit_property_sqlite(sqlite_engine: Engine, month: Month) -> None:
    """For any month of work: no negative line, credit <= charge, every format equal, residue explained, drafts stable and closed invoices byte-identical."""
    _property(sqlite_engine, month)


@pytest.mark.postgres
@settings(max_examples=6, **_SETTINGS)
@given(month=months())
def test_audit_property_postgresql(pg_engine: Engine, month: Month) -> None:
    """The same property on PostgreSQL, with fewer examples."""
    _property(pg_engine, month)


@pytest.fixture
def sqlite_engine(tmp_path) -> Iterator[Engine]:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(pg_database) -> Iterator[Engine]:  # type: ignore[no-untyped-def]
    from tests.db_fixtures import fresh_pg_schema

    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        engine = db.make_engine(url)
        yield engine
        engine.dispose()
