"""The KV credit as billed (billing/credit.py): bounded by what computing the cached tokens would have been charged.

Runs on SQLite and the machine's PostgreSQL: the rule exists as Python (one record) and as SQL (sums),
and the two must agree row for row.
"""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Engine, delete, select, update
from sqlalchemy.orm import Session

from billing.closing import close_period
from billing.config import LedgerConfig
from billing.credit import kv_credit_sql, kv_credit_us
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.models import Usage
from billing.records import AdapterLoadRecord
from tests.test_ledger import usage_record

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"))
MARCH = datetime(2026, 3, 10, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("fields", "credit"),
    [
        # The auditor's row: charged 46 ms, 992 of 1_000 prompt tokens cached, 846 ms "saved": credited 46 ms, net 0.
        (dict(kv_saved_us=846_000, base_us=40_000, lora_us=6_000, input_tokens=1_000, cached_tokens=992, output_tokens=16), 46_000),
        # A measured saving below the cap is credited whole: 10_000 <= 150_000 * 64 // 336 = 28_571.
        (dict(kv_saved_us=10_000, base_us=120_000, lora_us=30_000, input_tokens=300, cached_tokens=64, output_tokens=100), 10_000),
        # Above the request's own rate per computed token: 150_000 * 64 // 336 = 28_571 (rounded down).
        (dict(kv_saved_us=90_000, base_us=120_000, lora_us=30_000, input_tokens=300, cached_tokens=64, output_tokens=100), 28_571),
        (dict(kv_saved_us=5_000, base_us=80_000, lora_us=0, input_tokens=200, cached_tokens=0, output_tokens=10), 0),  # nothing cached
        (dict(kv_saved_us=5_000, base_us=0, lora_us=0, input_tokens=64, cached_tokens=64, output_tokens=0), 0),  # nothing computed
        (dict(kv_saved_us=5_000, base_us=9, lora_us=0, input_tokens=10, cached_tokens=20, output_tokens=0), 0),  # inconsistent counts
    ],
)
def test_credit_cases(fields: dict[str, int], credit: int) -> None:
    """min(measured, charged * min(cached, computed) // computed); zero where nothing was cached or computed."""
    assert kv_credit_us(**fields) == credit


_rows = st.fixed_dictionaries({
    "kv_saved_us": st.integers(0, 10**9), "base_us": st.integers(0, 10**9), "lora_us": st.integers(0, 10**8),
    "input_tokens": st.integers(0, 10**5), "cached_tokens": st.integers(0, 10**5), "output_tokens": st.integers(0, 10**4),
})


def _agree(engine: Engine, rows: list[dict[str, int]]) -> None:
    with engine.begin() as connection:
        connection.execute(delete(Usage))
    Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)})).record_usage(
        [usage_record(f"r{i}", created_at=MARCH, **row) for i, row in enumerate(rows)])
    with Session(engine) as session:
        sql = dict(session.execute(select(Usage.request_id, kv_credit_sql())).all())
    for i, row in enumerate(rows):
        credit = kv_credit_us(**row)
        assert sql[f"r{i}"] == credit, row
        assert 0 <= credit <= row["kv_saved_us"] and credit <= row["base_us"] + row["lora_us"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.lists(_rows, min_size=1, max_size=20))
def test_sql_and_python_agree(engine: Engine, rows: list[dict[str, int]]) -> None:
    """Row for row, the SQL credit equals the Python one, and it is never negative, above the measured saving or above the charge."""
    _agree(engine, rows)


def test_no_line_goes_negative(engine: Engine) -> None:
    """The auditor's row on an invoice: its line nets to the routing decision alone, never below zero, and so does its row's cost."""
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    ledger.record_usage([usage_record("r1", created_at=MARCH, adapter="x@1", kv_saved_us=846_000, base_us=40_000, lora_us=6_000,
                                      routing_us=300, input_tokens=1_000, cached_tokens=992, output_tokens=16)])
    (line,) = build_invoice(engine, "acme", "2026-03", CONFIG).lines
    assert (line.base_ms, line.lora_ms, line.routing_ms, line.kv_saved_ms, line.gpu_ms) == (
        Decimal("40.000"), Decimal("6.000"), Decimal("0.300"), Decimal("46.000"), Decimal("0.300"))
    assert line.cost >= 0 and ledger.usage_for("acme", "r1").cost == Decimal("0.000000600")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "row",
    [
        # input + output - cached passes int4: PostgreSQL refused every invoice and close of the month, SQLite billed it.
        dict(kv_saved_us=2**40, base_us=2**40, lora_us=7, input_tokens=2**31 - 1, cached_tokens=5, output_tokens=2**31 - 1),
        # cached * charged passes int8 (2^30 x 2^40): PostgreSQL failed, SQLite went to floats and credited 1 us too much.
        dict(kv_saved_us=2**47, base_us=2**40 + 12_345, lora_us=7, input_tokens=2**31 - 1, cached_tokens=2**30 - 1, output_tokens=0),
        # the largest times and counts the ledger takes, every product at its widest.
        dict(kv_saved_us=2**48, base_us=2**48, lora_us=2**48, input_tokens=2**31 - 1, cached_tokens=2**31 - 2, output_tokens=2**31 - 1),
    ],
)
def test_the_largest_rows_bill_alike_on_both_backends(engine: Engine, row: dict[str, int]) -> None:
    """Any row the ledger takes is billed by the rule, in integers, on SQLite and PostgreSQL alike: no int4/int8 overflow, no float."""
    _agree(engine, [row])
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    ledger.record_adapter_loads([AdapterLoadRecord(adapter="x@1", adapter_sha256="ab" * 32, tenant_id="acme", tier="disk", nbytes=1,
                                                   load_us=1_000, worker_id="w0", created_at=MARCH)])
    with engine.begin() as connection:
        connection.execute(update(Usage).values(adapter="x@1", adapter_sha256="ab" * 32))
    credit = kv_credit_us(**row)
    invoice = build_invoice(engine, "acme", "2026-03", CONFIG)
    assert invoice.totals.kv_saved_ms * 1000 == credit and invoice.totals.cold_start_ms == Decimal("1.000")
    assert invoice.gpu_us == row["base_us"] + row["lora_us"] - credit + 1_000
    closed = close_period(engine, CONFIG, "2026-03", now=datetime(2026, 4, 1, tzinfo=timezone.utc))
    assert [i.totals for i in closed] == [invoice.totals]
