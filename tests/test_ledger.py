"""The ledger's writes: idempotent rows, exact Decimal money, checked records and typed errors.

Runs on SQLite and the machine's PostgreSQL (fixtures from tests/db_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from billing import db
from billing.config import LedgerConfig
from billing.cost import gpu_cost
from billing.errors import LedgerRecordError, LedgerSchemaError, LedgerUnavailableError
from billing.ledger import Ledger
from billing.models import AdapterLoad
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord

PRICE = Decimal("2.50")
JAN = datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc)
SHA = "ab" * 32


def usage_record(request_id: str = "r1", **fields: object) -> UsageRecord:
    """A succeeded base-model request of tenant acme in January 2026, with `fields` overridden."""
    values: dict[str, object] = {"tenant_id": "acme", "request_id": request_id, "status": "succeeded", "created_at": JAN}
    return UsageRecord(**(values | fields))  # type: ignore[arg-type]


def load_record(**fields: object) -> AdapterLoadRecord:
    values: dict[str, object] = dict(
        adapter="summarize@1", adapter_sha256=SHA, tenant_id="platform", tier="disk", nbytes=1 << 20, load_us=40_000, worker_id="w0", created_at=JAN
    )
    return AdapterLoadRecord(**(values | fields))  # type: ignore[arg-type]


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url), gpu_price_per_hour=PRICE))


# ---- money -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpu_us", "price", "cost"),
    [
        (0, "2.50", "0.000000000"),
        (1_000_000, "2.50", "0.000694444"),  # 1 s = 1/3600 h: 0.000694444|4
        (3_600_000_000, "2.50", "2.500000000"),  # one hour
        (1, "3.60", "0.000000001"),  # 1 us at 3.60/h is exactly 1e-9
        (1, "1.80", "0.000000000"),  # 0.5e-9: half to even rounds down
        (3, "1.80", "0.000000002"),  # 1.5e-9: half to even rounds up
        (-36_000_000, "1.00", "-0.010000000"),  # a KV credit larger than the compute is a credit
        (3_600_000_000_000, "2.50", "2500.000000000"),  # 1000 hours
    ],
)
def test_gpu_cost_is_exact(gpu_us: int, price: str, cost: str) -> None:
    """cost = gpu_us * price / 3.6e9, rounded once, half to even, to nine places; always a Decimal."""
    value = gpu_cost(gpu_us, Decimal(price))
    assert isinstance(value, Decimal)
    assert format(value, "f") == cost


def _half_even(exact: Fraction, places: int) -> Fraction:
    scaled = exact * 10**places
    down = scaled.numerator // scaled.denominator
    rest = scaled - down
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and down % 2 == 1):
        down += 1
    return Fraction(down, 10**places)


@given(
    gpu_us=st.integers(min_value=-(10**12), max_value=10**14),
    price=st.decimals(min_value=0, max_value=10_000, places=4, allow_nan=False, allow_infinity=False),
)
def test_gpu_cost_matches_exact_rational_arithmetic(gpu_us: int, price: Decimal) -> None:
    """For any time and price, the cost equals the exact rational product rounded half-even to 1e-9."""
    expected = _half_even(Fraction(gpu_us) * Fraction(price) / 3_600_000_000, 9)
    assert Fraction(gpu_cost(gpu_us, price)) == expected


def test_stored_cost_is_exact_decimal(ledger: Ledger) -> None:
    """The cost column reads back as the exact Decimal: (base + lora + routing - KV credit) at the configured price."""
    ledger.record_usage(
        [
            # The credit stands whole: 250_000 <= 1_200_000 * 100 // 300 (billing/credit.py).
            usage_record("small", base_us=1_000_000, lora_us=200_000, routing_us=50_000, kv_saved_us=250_000,
                         input_tokens=300, cached_tokens=100, output_tokens=100),
            usage_record("large", base_us=3_600_000_000_000 + 1),  # 1000 h and 1 us: 13 significant digits
        ]
    )
    small, large = ledger.usage_for("acme", "small"), ledger.usage_for("acme", "large")
    assert small is not None and large is not None
    assert isinstance(small.cost, Decimal) and isinstance(large.cost, Decimal)
    assert small.cost == Decimal("0.000694444")
    assert large.cost == Decimal("2500.000000001")


# ---- idempotency -------------------------------------------------------------------------------------


def test_same_record_twice_is_one_row(ledger: Ledger) -> None:
    """Idempotency: a redelivered request adds no row, and the second write reports 0 new rows."""
    assert ledger.record_usage([usage_record("r1")]) == 1
    assert ledger.record_usage([usage_record("r1")]) == 0
    assert ledger.count_usage("acme") == 1


def test_duplicates_in_one_batch_are_one_row(ledger: Ledger) -> None:
    """Idempotency within a batch: copies of one request in the same flush add one row."""
    assert ledger.record_usage([usage_record("r1"), usage_record("r2"), usage_record("r1"), usage_record("r1")]) == 2
    assert ledger.count_usage() == 2


def test_redelivery_keeps_the_first_measurement(ledger: Ledger) -> None:
    """The first row written for a request is the one that stays; a re-run's different timings change nothing."""
    ledger.record_usage([usage_record("r1", base_us=1_000)])
    ledger.record_usage([usage_record("r1", base_us=9_999)])
    row = ledger.usage_for("acme", "r1")
    assert row is not None and row.base_us == 1_000


def test_request_ids_are_scoped_per_tenant(ledger: Ledger) -> None:
    """The idempotency key is (tenant, request_id): two tenants may both use request id r1."""
    assert ledger.record_usage([usage_record("r1"), usage_record("r1", tenant_id="globex")]) == 2
    assert (ledger.count_usage("acme"), ledger.count_usage("globex"), ledger.count_usage()) == (1, 1, 2)


def test_concurrent_workers_write_each_request_once(migrated_url: str) -> None:
    """Two workers (own engines) flushing overlapping batches at the same moment leave one row per request."""
    # 3000 rows keep both INSERTs running long enough to overlap; in opposite orders they deadlock
    # PostgreSQL unless the ledger orders its rows.
    records = [usage_record(f"r{i:04d}") for i in range(3000)]
    batches = [records, records[::-1]]
    barrier = threading.Barrier(len(batches))
    written: list[int] = []
    errors: list[BaseException] = []

    def worker(batch: list[UsageRecord]) -> None:
        engine = db.make_engine(migrated_url)
        try:
            ledger = Ledger(engine, LedgerConfig(url=migrated_url, gpu_price_per_hour=PRICE))
            barrier.wait()
            written.append(ledger.record_usage(batch))
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=worker, args=(batch,)) for batch in batches]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(written) == len(records)
    engine = db.make_engine(migrated_url)
    try:
        assert Ledger(engine, LedgerConfig(url=migrated_url)).count_usage() == len(records)
    finally:
        engine.dispose()


# ---- what a row holds --------------------------------------------------------------------------------


def test_row_holds_the_record(ledger: Ledger) -> None:
    """Every field of the record comes back as written; the instant is kept and read back in UTC."""
    record = usage_record(
        "r1",
        created_at=datetime(2026, 3, 1, 0, 30, 0, 123456, tzinfo=timezone(timedelta(hours=2))),
        adapter="summarize@1",
        adapter_sha256=SHA,
        batch_id="b7",
        route_reason="l1:user",
        status="failed",
        error_code="oom",
        input_tokens=11,
        output_tokens=22,
        cached_tokens=3,
        base_us=2**40,  # past 32 bits
        lora_us=5,
        routing_us=6,
        kv_saved_us=7,
        queue_us=8,
        ttft_us=9,
        total_us=10,
        worker_id="gpu-3",
        result_json='{"request_id": "r1", "text": "caf\u00e9"}',
    )
    ledger.record_usage([record])
    row = ledger.usage_for("acme", "r1")
    assert row is not None
    for field in dataclasses.fields(record):
        assert getattr(row, field.name) == getattr(record, field.name), field.name
    assert row.created_at.utcoffset() == timedelta(0)
    assert row.created_at == datetime(2026, 2, 28, 22, 30, 0, 123456, tzinfo=timezone.utc)
    assert row.period == "2026-02"  # the UTC month, not the local one
    assert ledger.usage_for("acme", "missing") is None


def test_adapter_loads_are_recorded(ledger: Ledger, engine: Engine) -> None:
    """Each adapter load is one row, filed under the UTC month it happened in."""
    late = datetime(2026, 2, 1, 0, 15, tzinfo=timezone(timedelta(hours=1)))  # 2026-01-31T23:15Z
    assert ledger.record_adapter_loads([load_record(), load_record(created_at=late, load_us=7)]) == 2
    with Session(engine) as session:
        rows = session.execute(select(AdapterLoad.load_us, AdapterLoad.period).order_by(AdapterLoad.load_us)).all()
    assert [tuple(r) for r in rows] == [(7, "2026-01"), (40_000, "2026-01")]


def test_empty_batches_write_nothing(ledger: Ledger) -> None:
    """An empty flush is a no-op that reports zero rows."""
    assert ledger.record_usage([]) == 0
    assert ledger.record_adapter_loads([]) == 0
    assert ledger.count_usage() == 0


# ---- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "field", "hint"),
    [
        ({"created_at": datetime(2026, 1, 1)}, "created_at", "timezone-aware"),
        ({"status": "ok"}, "status", "succeeded, failed"),
        ({"base_us": -1}, "base_us", "integer from 0"),
        ({"input_tokens": 1.5}, "input_tokens", "integer from 0"),
        ({"input_tokens": 2**31}, "input_tokens", "integer from 0 to 2147483647"),
        # 2^48 us (~8.9 years) at most: at BigInteger's own 2^63 - 1, base + LoRA of one row overflowed the invoice's SQL
        ({"base_us": 2**48 + 1}, "base_us", "integer from 0 to 281474976710656"),
        ({"kv_saved_us": 2**63 - 1}, "kv_saved_us", "integer from 0 to 281474976710656"),
        ({"adapter": "summarize"}, "adapter", "name@version"),
        ({"adapter_sha256": "AB" * 32}, "adapter_sha256", "64 lowercase hex"),
        ({"tenant_id": "t" * 65}, "tenant_id", "at most 64"),
        ({"request_id": ""}, "request_id", "non-empty"),
        # Instants no invoice can bill (billing/billable.py) were written, then billed to nobody; the last was an OverflowError
        ({"created_at": datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)}, "created_at", "from 1970-01 to 9998-12 UTC"),
        ({"created_at": datetime(9999, 1, 1, tzinfo=timezone.utc)}, "created_at", "from 1970-01 to 9998-12 UTC"),
        ({"created_at": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=5)))}, "created_at", "from 1970-01 to 9998-12 UTC"),
    ],
)
def test_bad_record_fails_the_whole_batch(ledger: Ledger, fields: dict[str, object], field: str, hint: str) -> None:
    """A record that does not fit the ledger is refused with an error naming the field and the fix; nothing is written."""
    with pytest.raises(LedgerRecordError) as raised:
        ledger.record_usage([usage_record("good"), usage_record(**({"request_id": "bad"} | fields))])
    assert f"{field}=" in str(raised.value) and hint in str(raised.value)
    assert ledger.count_usage() == 0


def test_a_request_costing_a_billion_is_refused_by_name(engine: Engine) -> None:
    """A row whose own cost passes its numeric(18, 9) column is a LedgerRecordError naming the field on both backends, nothing
    written: PostgreSQL raised a DataError the worker took for an outage (spooled, retried, holding the records behind it),
    SQLite stored it."""
    ledger = Ledger(engine, LedgerConfig(url=str(engine.url), gpu_price_per_hour=Decimal("100000")))
    with pytest.raises(LedgerRecordError, match=r"request_id='bad': base_us=281474976710656 .* below 1000000000"):
        ledger.record_usage([usage_record("good"), usage_record("bad", base_us=2**48)])  # 7,818,749,353 at 100,000 an hour
    assert ledger.count_usage() == 0
    assert ledger.record_usage([usage_record("hour", base_us=3_600_000_000)]) == 1
    assert ledger.usage_for("acme", "hour").cost == Decimal("100000.000000000")  # type: ignore[union-attr]


def test_bad_adapter_load_is_refused(ledger: Ledger) -> None:
    """An adapter load without a name@version is refused with an error naming the field."""
    with pytest.raises(LedgerRecordError, match="adapter='summarize'.*name@version"):
        ledger.record_adapter_loads([load_record(adapter="summarize")])


def test_records_of_months_no_invoice_bills_are_refused(ledger: Ledger) -> None:
    """An adapter load or busy record whose instant lies outside 1970-01..9998-12 UTC is refused by name, as a usage row is:
    no cold-start spread or reconciliation of its month can be made. The first and last billable instants are taken."""
    for moment in (datetime(1969, 12, 31, 23, tzinfo=timezone.utc), datetime(9999, 12, 31, 20, tzinfo=timezone(-timedelta(hours=5)))):
        with pytest.raises(LedgerRecordError, match=r"created_at=.* from 1970-01 to 9998-12 UTC"):
            ledger.record_adapter_loads([load_record(created_at=moment)])
        with pytest.raises(LedgerRecordError, match=r"started_at=.* from 1970-01 to 9998-12 UTC"):
            ledger.record_busy([BusyRecord(worker_id="w0", gpu_kind="default", started_at=moment, ended_at=moment, busy_us=0, steps=0)])
    first, last = datetime(1970, 1, 1, tzinfo=timezone.utc), datetime(9998, 12, 31, 23, 59, 59, 999999, tzinfo=timezone.utc)
    assert ledger.record_usage([usage_record("first", created_at=first), usage_record("last", created_at=last)]) == 2
    assert ledger.record_adapter_loads([load_record(created_at=first), load_record(created_at=last)]) == 2


def test_unmigrated_database_says_to_migrate(db_url: str) -> None:
    """Writing to a database that was never migrated fails with LedgerSchemaError telling how to migrate."""
    engine = db.make_engine(db_url)
    try:
        with pytest.raises(LedgerSchemaError, match=r"revision None but this code needs .*upgrade head") as raised:
            Ledger(engine, LedgerConfig(url=db_url)).record_usage([usage_record()])
        assert raised.value.retriable is False
    finally:
        engine.dispose()


def test_unreachable_database_is_retriable() -> None:
    """A database that does not answer is a retriable LedgerUnavailableError that says retrying is safe."""
    url = "postgresql+psycopg://postgres@127.0.0.1:1/nothing?connect_timeout=2"
    engine = db.make_engine(url)
    try:
        with pytest.raises(LedgerUnavailableError, match="retry") as raised:
            Ledger(engine, LedgerConfig(url=url)).record_usage([usage_record()])
        assert raised.value.retriable is True
    finally:
        engine.dispose()
