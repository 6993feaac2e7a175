"""Per-period conservation and idempotency: busy records, usage, loads and invoices agree to the microsecond.

What is conserved (billing/conservation.py): for a month, the base + LoRA time of its requests equals
the busy time of its GPU busy records, and the cold-start time on its invoices equals the load time of
the adapters that had requests in it. Runs on SQLite and the machine's PostgreSQL.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select
from sqlalchemy.orm import Session

from billing import db
from billing.closing import close_period
from billing.config import LedgerConfig
from billing.conservation import period_conservation
from billing.errors import LedgerRecordError
from billing.invoice import period_invoices
from billing.invoice_render import render_json
from billing.ledger import Ledger
from billing.models import Base, Busy
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from engine.timing import attribute_step
from migrations import SCRIPT_LOCATION

PRICE = Decimal("7.20")
CONFIG = LedgerConfig(gpu_price_per_hour=PRICE)
OCT = datetime(2026, 10, 1, tzinfo=timezone.utc)
ADAPTERS = {"x@1": "11" * 32, "y@1": "22" * 32, "z@1": "33" * 32}  # z@1 is loaded but never used


def busy(worker: str, start: datetime, busy_us: int, steps: int = 1, span_us: int | None = None) -> BusyRecord:
    end = start + timedelta(microseconds=busy_us if span_us is None else span_us)
    return BusyRecord(worker_id=worker, gpu_kind="h100", started_at=start, ended_at=end, busy_us=busy_us, steps=steps)


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    return Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))


# ---- busy records ------------------------------------------------------------------------------------


def test_busy_records_are_idempotent(ledger: Ledger, engine: Engine) -> None:
    """Idempotency: a busy record written twice (same worker and start) is one row; the month is its start's UTC month."""
    records = [busy("w0", OCT + timedelta(seconds=1), 5_000), busy("w0", datetime(2026, 9, 30, 23, 59, 59, tzinfo=timezone.utc), 500, span_us=1_000_000)]
    assert ledger.record_busy(records) == 2
    assert ledger.record_busy(records + [busy("w1", OCT, 7)]) == 1
    with Session(engine) as session:
        assert sorted(session.execute(select(Busy.worker_id, Busy.period, Busy.busy_us))) == [("w0", "2026-09", 500), ("w0", "2026-10", 5_000), ("w1", "2026-10", 7)]


@pytest.mark.parametrize(
    ("record", "field", "hint"),
    [
        (busy("w0", OCT, 10_001, steps=0, span_us=10_000), "busy_us", "cannot be busy longer"),
        (busy("w0", OCT, 0, span_us=-1), "ended_at", "at or after started_at"),
        (BusyRecord("w0", "h100", datetime(2026, 10, 1), datetime(2026, 10, 1), 0, 0), "started_at", "timezone-aware"),
        (busy("", OCT, 1), "worker_id", "non-empty"),
        (busy("w0", OCT, -5), "busy_us", "integer from 0"),
    ],
)
def test_bad_busy_record_is_refused(ledger: Ledger, record: BusyRecord, field: str, hint: str) -> None:
    """A busy record that cannot be true (busier than its wall span, ending before it starts, naive times) is refused, naming the field and the fix."""
    with pytest.raises(LedgerRecordError, match=f"{field}=.*{hint}"):
        ledger.record_busy([record])


def test_step_rounding_slack_is_allowed(ledger: Ledger) -> None:
    """Step times are rounded one by one, so busy may pass the wall span by one microsecond per step, and no more."""
    assert ledger.record_busy([busy("w0", OCT, 10_003, steps=3, span_us=10_000)]) == 1


# ---- conservation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One engine step as measured: its time, the LoRA part of it, and (request_id, tokens, adapter) per request."""

    total_us: int
    lora_us: int
    requests: tuple[tuple[str, int, str | None], ...]


def _batch(steps: list[Step], tenant_of: dict[str, str], adapter_of: dict[str, str | None], start: datetime, worker: str) -> tuple[list[UsageRecord], BusyRecord]:
    """The usage rows and the busy record one engine batch of `steps` produces, times split by the engine's own attribute_step."""
    times: dict[str, list[int]] = {}
    tokens: dict[str, int] = {}
    for i, step in enumerate(steps):
        record = attribute_step(i, step.total_us, step.lora_us, [((tenant_of[rid], rid), n, adapter is not None) for rid, n, adapter in step.requests])
        for share in record.shares:
            base_lora = times.setdefault(share.request_id, [0, 0])
            base_lora[0] += share.base_us
            base_lora[1] += share.lora_us
            tokens[share.request_id] = tokens.get(share.request_id, 0) + share.tokens
    usage = [
        UsageRecord(tenant_id=tenant_of[rid], request_id=rid, status="succeeded", created_at=start, adapter=adapter_of[rid],
                    adapter_sha256=ADAPTERS.get(adapter_of[rid] or ""), input_tokens=tokens[rid],
                    output_tokens=1, base_us=base_us, lora_us=lora_us, routing_us=37, worker_id=worker)
        for rid, (base_us, lora_us) in sorted(times.items())
    ]
    total = sum(s.total_us for s in steps)
    return usage, busy(worker, start, total, steps=len(steps), span_us=total + 1_000)


def test_period_conservation_by_hand(ledger: Ledger, engine: Engine) -> None:
    """Per-period conservation: October's base + LoRA equals October's busy time; its invoices' cold start equals the loads of used adapters; a batch started at November's first instant is November's."""
    tenant_of = {"a": "acme", "b": "acme", "g": "globex", "n": "acme"}
    adapter_of: dict[str, str | None] = {"a": "x@1", "b": None, "g": "x@1", "n": "y@1"}
    steps = [Step(1_000, 200, (("a", 3, "x@1"), ("b", 1, None), ("g", 2, "x@1"))),
             Step(333, 33, (("a", 1, "x@1"), ("g", 1, "x@1")))]
    usage, record = _batch(steps, tenant_of, adapter_of, OCT + timedelta(days=3), "w0")
    nov_usage, nov_record = _batch([Step(999, 99, (("n", 1, "y@1"),))], tenant_of, adapter_of, datetime(2026, 11, 1, tzinfo=timezone.utc), "w0")
    ledger.record_usage(usage + nov_usage)
    ledger.record_busy([record, nov_record])
    ledger.record_adapter_loads([
        AdapterLoadRecord("x@1", ADAPTERS["x@1"], "platform", "disk", 1, 40_001, "w0", OCT + timedelta(days=2)),
        AdapterLoadRecord("z@1", ADAPTERS["z@1"], "platform", "host", 1, 5_000, "w0", OCT + timedelta(days=2)),
    ])
    october = period_conservation(engine, "2026-10", CONFIG)
    assert (october.attributed_us, october.busy_us, october.unattributed_us) == (1_333, 1_333, 0)
    assert (october.cold_start_us, october.load_us, october.unbilled_load_us) == (40_001, 40_001, 5_000)
    november = period_conservation(engine, "2026-11", CONFIG)
    assert (november.attributed_us, november.busy_us) == (999, 999)
    close_period(engine, CONFIG, "2026-10", now=datetime(2026, 11, 2, tzinfo=timezone.utc))
    assert period_conservation(engine, "2026-10", CONFIG) == october  # the frozen invoices carry the same cold start


def test_two_workers_recording_the_same_work(migrated_url: str) -> None:
    """Idempotency under two workers (own engines, threads) writing the same usage, busy records and loads at once: one row each."""
    usage = [UsageRecord(tenant_id=f"t{i % 3}", request_id=f"r{i:04d}", status="succeeded", created_at=OCT, base_us=i) for i in range(2_000)]
    busy_records = [busy("w0", OCT + timedelta(seconds=i), 10) for i in range(50)]
    loads = [AdapterLoadRecord("x@1", ADAPTERS["x@1"], "platform", "disk", 1, 100, "w0", OCT + timedelta(seconds=i)) for i in range(20)]
    barrier = threading.Barrier(2)
    written: list[tuple[int, int, int]] = []
    errors: list[BaseException] = []

    def worker(order: int) -> None:
        engine = db.make_engine(migrated_url)
        try:
            ledger = Ledger(engine, CONFIG.model_copy(update={"url": migrated_url}))
            barrier.wait()
            written.append((ledger.record_usage(usage[::order]), ledger.record_busy(busy_records[::order]), ledger.record_adapter_loads(loads[::order])))
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=worker, args=(order,)) for order in (1, -1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [sum(column) for column in zip(*written)] == [2_000, 50, 20]
    engine = db.make_engine(migrated_url)
    try:
        conservation = period_conservation(engine, "2026-10", CONFIG)
        assert (conservation.attributed_us, conservation.busy_us, conservation.load_us) == (sum(range(2_000)), 500, 0)
        assert conservation.unbilled_load_us == 2_000  # nobody used x@1 in these rows
    finally:
        engine.dispose()


# ---- the property ------------------------------------------------------------------------------------


_LEDGER_TABLES = ("invoice_lines", "invoices", "cold_start_shares", "billing_periods", "gpu_busy", "adapter_loads", "usage", "usage_redeliveries")


def _wipe(engine: Engine) -> None:
    """Empty the ledger between examples (one migrated database per test, not per example)."""
    with engine.begin() as connection:
        for name in _LEDGER_TABLES:
            connection.execute(delete(Base.metadata.tables[name]))


@st.composite
def month_of_work(draw: st.DrawFn) -> tuple[list[UsageRecord], list[BusyRecord], list[AdapterLoadRecord]]:
    """A month of random engine batches (steps over requests of 3 tenants, some with adapters), plus adapter loads."""
    usage: list[UsageRecord] = []
    busy_records: list[BusyRecord] = []
    for b in range(draw(st.integers(1, 4))):
        ids = [f"r{b}-{i}" for i in range(draw(st.integers(1, 5)))]
        tenant_of = {rid: draw(st.sampled_from(["t0", "t1", "t2"])) for rid in ids}
        adapter_of = {rid: draw(st.sampled_from([None, "x@1", "y@1"])) for rid in ids}
        steps = []
        for _ in range(draw(st.integers(1, 4))):
            present = draw(st.lists(st.sampled_from(ids), min_size=1, unique=True))
            requests = tuple((rid, draw(st.integers(1, 64)), adapter_of[rid]) for rid in present)
            total = draw(st.integers(0, 10**7))
            lora = draw(st.integers(0, total)) if any(adapter for _, _, adapter in requests) else 0
            steps.append(Step(total, lora, requests))
        stepped = {rid for s in steps for rid, _, _ in s.requests}
        tenant_of = {rid: tenant_of[rid] for rid in stepped}
        start = OCT + timedelta(days=draw(st.integers(0, 30)), seconds=b)
        batch_usage, record = _batch(steps, tenant_of, adapter_of, start, f"w{b % 2}")
        usage += batch_usage
        busy_records.append(record)
    loads = [
        AdapterLoadRecord(adapter, ADAPTERS[adapter], "platform", "disk", 1, draw(st.integers(0, 10**6)), f"w{i % 2}", OCT + timedelta(hours=i))
        for i, adapter in enumerate(draw(st.lists(st.sampled_from(sorted(ADAPTERS)), max_size=4)))
    ]
    return usage, busy_records, loads


def _deliver(ledger: Ledger, work: tuple[list[UsageRecord], list[BusyRecord], list[AdapterLoadRecord]], rng: random.Random) -> None:
    """Write the work at least once: shuffled, in random chunks, with random records delivered again."""
    usage, busy_records, loads = work
    redelivered = usage + rng.sample(usage, k=rng.randint(0, len(usage)))
    rng.shuffle(redelivered)
    cut = rng.randint(0, len(redelivered))
    ledger.record_usage(redelivered[:cut])
    ledger.record_busy(busy_records + busy_records[: rng.randint(0, len(busy_records))])
    ledger.record_usage(redelivered[cut:])
    ledger.record_adapter_loads(loads + loads[: rng.randint(0, len(loads))])


def _property(engine: Engine, work: tuple[list[UsageRecord], list[BusyRecord], list[AdapterLoadRecord]], seed: int) -> None:
    _wipe(engine)
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    rng = random.Random(seed)
    _deliver(ledger, work, rng)
    usage, busy_records, loads = work
    assert ledger.count_usage() == len(usage)
    before = period_conservation(engine, "2026-10", CONFIG)
    assert before.attributed_us == before.busy_us == sum(r.busy_us for r in busy_records)
    assert before.cold_start_us == before.load_us
    assert before.load_us + before.unbilled_load_us == sum(load.load_us for load in loads)
    closed = close_period(engine, CONFIG, "2026-10", now=datetime(2026, 11, 1, tzinfo=timezone.utc))
    _deliver(ledger, work, rng)  # everything again, after the close: nothing changes
    assert ledger.count_usage() == len(usage)
    assert [render_json(i) for i in period_invoices(engine, "2026-10", CONFIG)] == [render_json(i) for i in closed]
    assert period_conservation(engine, "2026-10", CONFIG) == before
    assert sum(i.totals.cost for i in closed) == sum(line.cost for i in closed for line in i.lines)
    assert all(type(i.totals.cost) is Decimal and type(i.totals.revenue) is Decimal for i in closed)


_SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]}


@settings(max_examples=30, **_SETTINGS)
@given(work=month_of_work(), seed=st.integers(0, 2**32))
def test_conservation_and_idempotency_property_sqlite(sqlite_engine: Engine, work: tuple, seed: int) -> None:
    """For any mix of batches, loads and redeliveries: one row per request, base + LoRA == busy, cold start == used load time, and the closed month unchanged by redelivering it all."""
    _property(sqlite_engine, work, seed)


@pytest.mark.postgres
@settings(max_examples=8, **_SETTINGS)
@given(work=month_of_work(), seed=st.integers(0, 2**32))
def test_conservation_and_idempotency_property_postgresql(pg_engine: Engine, work: tuple, seed: int) -> None:
    """The same property on PostgreSQL, with fewer examples."""
    _property(pg_engine, work, seed)


@pytest.fixture
def sqlite_engine(tmp_path) -> Engine:  # type: ignore[no-untyped-def]
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    db.upgrade(url, script_location=SCRIPT_LOCATION)
    engine = db.make_engine(url)
    yield engine
    engine.dispose()


@pytest.fixture
def pg_engine(pg_database) -> Engine:  # type: ignore[no-untyped-def]
    from tests.db_fixtures import fresh_pg_schema

    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        engine = db.make_engine(url)
        yield engine
        engine.dispose()
