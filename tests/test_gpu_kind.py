"""Each usage and load row is priced at the GPU kind that ran it, not at the invoicing process's own ledger.gpu_kind.

Runs on SQLite and the machine's PostgreSQL. Prices make the sums easy: h100 at 3.60 an hour is 1e-9 per
microsecond, h200 at 7.20 is 2e-9. March 2026, tenant acme:

    a1  base  h100  1_000_000 us   0.001
    a2  base  h200  1_000_000 us   0.002
    a3  x@1   h100  2_000_000 us   0.002
    x@1 loaded on h200 for 1_000_000 us, all a3's      0.002      total 0.007
"""

from __future__ import annotations

import json
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition
from sqlalchemy import Engine, inspect, select, text
from sqlalchemy.orm import Session

from billing import db
from billing.closing import close_period
from billing.config import LedgerConfig
from billing.errors import UnpricedGpuKindError
from billing.invoice import build_invoice, read_closed
from billing.ledger import Ledger
from billing.models import BillingPeriod, Usage
from billing.prices import set_gpu_price
from consumer.delivery import Deliverer, Outcome
from consumer.feeder import EngineFeeder
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.spool import Spool, _decode, _encode
from migrations import SCRIPT_LOCATION
from tests.test_ledger import load_record, usage_record
from tests.test_unbilled_work import _StubEngine

S1 = "11" * 32
MARCH_2 = datetime(2026, 3, 2, 12, tzinfo=timezone.utc)
APRIL_2 = datetime(2026, 4, 2, tzinfo=timezone.utc)
# Finance's config names neither workers' kind, and a fallback price of its own: neither may touch the total.
FINANCE = LedgerConfig(gpu_kind="finance-laptop", gpu_price_per_hour=Decimal("99"))


def _prices(engine: Engine) -> None:
    set_gpu_price(engine, "h100", Decimal("3.60"), date(2026, 3, 1), currency="USD")
    set_gpu_price(engine, "h200", Decimal("7.20"), date(2026, 3, 1), currency="USD")


def _two_kinds(engine: Engine) -> None:
    _prices(engine)
    ledger = Ledger(engine, LedgerConfig(url=str(engine.url), gpu_kind="h100"))
    ledger.record_usage([
        usage_record("a1", created_at=MARCH_2, base_us=1_000_000, gpu_kind="h100"),
        usage_record("a2", created_at=MARCH_2, base_us=1_000_000, gpu_kind="h200"),
        usage_record("a3", created_at=MARCH_2, adapter="x@1", adapter_sha256=S1, output_tokens=1, base_us=2_000_000, gpu_kind="h100"),
    ])
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=1_000_000, created_at=MARCH_2, gpu_kind="h200")])


def _lines(invoice) -> list[tuple]:
    return [(line.adapter, line.gpu_price_per_hour, line.gpu_ms, line.cost) for line in invoice.lines]


EXPECTED = [
    ("base", Decimal("3.60"), Decimal("1000.000"), Decimal("0.001")),
    ("base", Decimal("7.20"), Decimal("1000.000"), Decimal("0.002")),
    ("x@1", Decimal("3.60"), Decimal("2000.000"), Decimal("0.002")),
    ("x@1", Decimal("7.20"), Decimal("1000.000"), Decimal("0.002")),  # the load on h200, alone
]


def test_a_month_of_two_kinds_bills_each_at_its_price(engine: Engine) -> None:
    """Usage and loads of two GPU kinds in one month: each row's time at its own kind's price, in the draft and as
    closed, whatever kind the invoicing config names (here neither: it priced all 5,000 ms at 99 an hour before)."""
    _two_kinds(engine)
    draft = build_invoice(engine, "acme", "2026-03", FINANCE, now=APRIL_2)
    assert _lines(draft) == EXPECTED
    assert draft.totals.cost == Decimal("0.007")
    closed = close_period(engine, FINANCE, "2026-03", now=APRIL_2)
    assert [i.tenant for i in closed] == ["acme"]
    assert _lines(closed[0]) == EXPECTED and closed[0].totals.cost == Decimal("0.007")


@pytest.mark.parametrize("config", [
    LedgerConfig(gpu_kind="h100", gpu_price_per_hour=Decimal("1")),
    LedgerConfig(gpu_kind="h200", gpu_price_per_hour=Decimal("1")),
    LedgerConfig(),  # gpu_kind "default" at 2.50
], ids=["h100", "h200", "default"])
def test_the_invoicing_configs_kind_does_not_change_the_total(engine: Engine, config: LedgerConfig) -> None:
    """The invoice total is the same under any ledger.gpu_kind (before, each config priced every hour at its own kind)."""
    _two_kinds(engine)
    assert build_invoice(engine, "acme", "2026-03", config, now=APRIL_2).totals.cost == Decimal("0.007")


@pytest.mark.parametrize("unpriced", ["usage", "load"])
def test_a_kind_without_a_price_is_refused_naming_it(engine: Engine, unpriced: str) -> None:
    """A row (or load) of a kind with no price in effect is refused, naming the kind and the command that prices it; a
    close refused so freezes nothing. The config's own kind with no entry still takes ledger.gpu_price_per_hour."""
    _prices(engine)
    ledger = Ledger(engine, LedgerConfig(url=str(engine.url), gpu_kind="h100"))
    ledger.record_usage([
        usage_record("a1", created_at=MARCH_2, adapter="x@1", adapter_sha256=S1, base_us=1_000_000, gpu_kind="a10" if unpriced == "usage" else "h100"),
        usage_record("a2", created_at=MARCH_2, base_us=1_000_000, gpu_kind="finance-laptop"),
    ])
    ledger.record_adapter_loads([load_record(adapter="x@1", adapter_sha256=S1, load_us=1_000, created_at=MARCH_2,
                                             gpu_kind="a10" if unpriced == "load" else "h200")])
    with pytest.raises(UnpricedGpuKindError, match=r"gpu_kind 'a10'.*`lorabatch prices set-gpu a10 PRICE --from DAY`"):
        build_invoice(engine, "acme", "2026-03", FINANCE, now=APRIL_2)
    with pytest.raises(UnpricedGpuKindError, match="'a10'"):
        close_period(engine, FINANCE, "2026-03", now=APRIL_2)
    with Session(engine) as session:
        assert read_closed(session, "2026-03") == {}
        assert session.scalar(select(BillingPeriod.spread_frozen_at).where(BillingPeriod.period == "2026-03")) is None
    set_gpu_price(engine, "a10", Decimal("1.80"), date(2026, 3, 1), currency="USD")
    lines = _lines(build_invoice(engine, "acme", "2026-03", FINANCE, now=APRIL_2))
    assert ("base", Decimal("99"), Decimal("1000.000"), Decimal("0.0275")) in lines  # finance-laptop: the fallback


def test_rows_without_a_kind_keep_the_configs_pricing(engine: Engine) -> None:
    """Rows that record no kind (written before revision 0009, or by a writer that names none) are priced as before:
    the list of the invoicing config's gpu_kind, its gpu_price_per_hour where that list has no entry."""
    _prices(engine)
    Ledger(engine, LedgerConfig(url=str(engine.url))).record_usage([usage_record("a1", created_at=MARCH_2, base_us=1_000_000)])
    assert _lines(build_invoice(engine, "acme", "2026-03", LedgerConfig(gpu_kind="h200"), now=APRIL_2)) == [
        ("base", Decimal("7.20"), Decimal("1000.000"), Decimal("0.002"))]
    assert _lines(build_invoice(engine, "acme", "2026-03", LedgerConfig(gpu_price_per_hour=Decimal("36")), now=APRIL_2)) == [
        ("base", Decimal("36"), Decimal("1000.000"), Decimal("0.01"))]


def test_0009_adds_gpu_kind_and_keeps_old_rows(db_url: str) -> None:
    """0009 adds usage.gpu_kind and adapter_loads.gpu_kind, NULL on the rows already there, which invoices price as the
    config's kind; a new row's kind prices it; the downgrade drops the columns and keeps every row."""
    db.upgrade(db_url, "0008", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    usage = ("INSERT INTO usage (tenant_id, request_id, status, route_reason, input_tokens, output_tokens, cached_tokens, base_us, lora_us, "
             "routing_us, kv_saved_us, queue_us, ttft_us, total_us, cost, period, invoice_period, created_at, worker_id) VALUES "
             "('acme', 'old', 'succeeded', '', 1, 1, 0, 1000000, 0, 0, 0, 0, 0, 5, 0, '2026-03', '2026-03', '2026-03-02 10:00:00+00', 'w0')")
    load = ("INSERT INTO adapter_loads (adapter, adapter_sha256, tenant_id, tier, nbytes, load_us, worker_id, created_at, period, "
            f"invoice_period) VALUES ('x@1', '{'a' * 64}', 'acme', 'disk', 1, 7, 'w0', '2026-03-02 09:00:00+00', '2026-03', '2026-03')")
    try:
        with engine.begin() as connection:
            connection.execute(text(usage))
            connection.execute(text(load))
        db.upgrade(db_url, "0009", script_location=SCRIPT_LOCATION)
        engine.dispose()
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id, gpu_kind FROM usage")).all() == [("old", None)]
            assert connection.execute(text("SELECT load_us, gpu_kind FROM adapter_loads")).all() == [(7, None)]
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)  # the head, which today's ledger writes
        engine.dispose()
        _prices(engine)
        Ledger(engine, LedgerConfig(url=db_url)).record_usage([usage_record("new", created_at=MARCH_2, base_us=1_000_000, gpu_kind="h200")])
        invoice = build_invoice(engine, "acme", "2026-03", LedgerConfig(gpu_kind="h100"), now=APRIL_2)
        assert [(line.gpu_price_per_hour, line.requests) for line in invoice.lines] == [(Decimal("3.60"), 1), (Decimal("7.20"), 1)]
        db.downgrade(db_url, "0008", script_location=SCRIPT_LOCATION)
        engine.dispose()  # SQLite's batch mode rebuilt the tables under the pooled connections
        for table in ("usage", "adapter_loads"):
            assert "gpu_kind" not in {c["name"] for c in inspect(engine).get_columns(table)}
        with engine.connect() as connection:
            assert connection.execute(text("SELECT request_id FROM usage ORDER BY request_id")).scalars().all() == ["new", "old"]
            assert connection.execute(text("SELECT count(*) FROM adapter_loads")).scalar() == 1
    finally:
        engine.dispose()


def test_a_blank_kind_is_refused_naming_the_field(engine: Engine) -> None:
    """A record whose gpu_kind names no price list is refused before anything is written."""
    ledger = Ledger(engine, LedgerConfig(url=str(engine.url)))
    with pytest.raises(ValueError, match="gpu_kind"):
        ledger.record_usage([usage_record("a1", gpu_kind=" ")])
    with Session(engine) as session:
        assert session.scalar(select(Usage.id)) is None


def test_the_worker_stamps_its_kind_and_the_spool_keeps_it(tmp_path: Path) -> None:
    """Usage the worker emits carries its ledger.gpu_kind (a kind already set is kept), and survives the spool."""
    spool = Spool(tmp_path / "spool.sqlite", max_records=10)
    try:
        d = Deliverer(None, None, None, OffsetTracker(), WorkerMetrics(), "w1", lambda t: True, spool, gpu_kind="h200")
        d.emit(Outcome(TopicPartition("jobs", 0), 0, usage=usage_record("a1")))
        d.emit(Outcome(TopicPartition("jobs", 0), 1, usage=usage_record("a2", gpu_kind="h100")))
        assert [o.usage.gpu_kind for o in d.outbox] == ["h200", "h100"]
        loads = [load_record(gpu_kind="h200")]
        spool.put([o.usage for o in d.outbox])
        spool.put(loads)
        kind, ids, records = spool.oldest(10)
        assert (kind, [r.gpu_kind for r in records]) == ("usage", ["h200", "h100"])
        spool.remove(ids)
        assert spool.oldest(10)[2] == loads
        # A record spooled by the version before (no gpu_kind in its body) reads back with none: priced as before.
        body = json.loads(_encode(usage_record("a9")))
        del body["gpu_kind"]
        assert _decode("usage", json.dumps(body)) == usage_record("a9", gpu_kind=None)
    finally:
        spool.close()


async def test_the_worker_stamps_its_kind_on_adapter_loads() -> None:
    """An adapter load the worker records names the GPU kind it was loaded onto, as its busy records do."""
    stub = _StubEngine()
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h200")
    feeder._adapters["k"] = SimpleNamespace(adapter="x@1", sha256=S1, tenant_id="acme")
    load = SimpleNamespace(key="k", error_code=None, skip_reason=None, load_us=40, tier="disk", nbytes=5)
    stub.gpu = ([load], 100, 1, feeder._since + timedelta(seconds=1), 0)
    loads, busy = await feeder.drain_gpu_time()
    assert [(r.adapter, r.gpu_kind) for r in loads] == [("x@1", "h200")] and busy.gpu_kind == "h200"
