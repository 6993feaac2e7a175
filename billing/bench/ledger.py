"""`lorabatch bench ledger`: insert rate, one tenant's invoice time and a month's close time, on a real database.

What is measured:
  insert  -- Ledger.record_usage, the worker's own write path (its delivery task flushes its outbox
             through it), called with `batch` records at a time: validation, filing into the open
             period (period lock, closed-invoice check), pricing, and multi-row INSERT ... ON CONFLICT
             DO NOTHING RETURNING through SQLAlchemy (insertmanyvalues, 1000 rows a statement). The
             rate is rows over the seconds spent inside record_usage; making the records (the worker's
             engine and job parsing) is timed apart and reported as `generate_s`.
  analyze -- ANALYZE of the ledger tables after the load, as autovacuum does after a bulk change; with
             the statistics of the empty table it started from, PostgreSQL plans the invoice's
             aggregates for a few rows, and the invoice below took 2.3-2.7 s instead of 0.8 s.
  invoice -- build_invoice of the tenant with the most rows: the draft, with the live cold-start spread.
  close   -- close_period of the month: freeze the spread, price and store every tenant's invoice.

The bench never touches existing data: on PostgreSQL it works in a fresh schema of the given database,
dropped at the end; on SQLite in a fresh file beside the given one, deleted at the end (billing.bench.scratch).
"""

from __future__ import annotations

import itertools
import json
import random
import time
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from sqlalchemy import Engine, func, select
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from billing import db
from billing.bench.scratch import scratch_database
from billing.closing import close_period
from billing.config import LedgerConfig
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.models import Tenant, Usage
from billing.periods import period_end, period_start
from billing.prices import set_gpu_price, set_token_price
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord

PERIOD = "2026-01"
TENANTS = 50
ADAPTERS = 40
GPU_KIND = "bench-gpu"
TIERS = {"standard": (Decimal("0.20"), Decimal("0.60")), "premium": (Decimal("0.50"), Decimal("1.50")), "batch": (Decimal("0.10"), Decimal("0.30"))}


@dataclass
class _Fleet:
    """The synthetic month: tenants with tiers, adapters (one in four shared by every tenant), a seeded RNG."""

    rng: random.Random
    tenants: list[str]
    adapters: list[tuple[str, str]]  # (name@version, sha256)

    @classmethod
    def make(cls, seed: int = 0) -> _Fleet:
        rng = random.Random(seed)
        adapters = [(f"adapter{i:02d}@1", f"{rng.getrandbits(256):064x}") for i in range(ADAPTERS)]
        return cls(rng, [f"tenant{i:02d}" for i in range(TENANTS)], adapters)

    def __post_init__(self) -> None:
        # Tenant popularity is skewed as in a real fleet: Zipf weights 1/(i+1), tenant00 ~22% of rows.
        self._weights = list(itertools.accumulate(1 / (i + 1) for i in range(len(self.tenants))))

    def usage(self, start: int, count: int) -> list[UsageRecord]:
        rng, records = self.rng, []
        month_us = (period_end(PERIOD) - period_start(PERIOD)) // timedelta(microseconds=1)
        for n in range(start, start + count):
            tenant = rng.choices(self.tenants, cum_weights=self._weights)[0]
            adapter, sha = self.adapters[rng.randrange(ADAPTERS)] if rng.random() < 0.85 else (None, None)
            base_us, lora_us = rng.randrange(20_000, 400_000), rng.randrange(1_000, 60_000) if adapter else 0
            records.append(UsageRecord(
                tenant_id=tenant, request_id=f"req-{n:09d}", status="succeeded" if rng.random() < 0.98 else "failed",
                created_at=period_start(PERIOD) + timedelta(microseconds=n * (month_us // (start + count + 1))),
                adapter=adapter, adapter_sha256=sha, batch_id=f"batch-{n // 500}", route_reason="explicit",
                input_tokens=rng.randrange(20, 2_000), output_tokens=rng.randrange(1, 500), cached_tokens=rng.randrange(0, 64),
                base_us=base_us, lora_us=lora_us, routing_us=rng.randrange(5, 400), kv_saved_us=rng.randrange(0, 2_000),
                queue_us=rng.randrange(0, 50_000), ttft_us=rng.randrange(5_000, 80_000), total_us=base_us + lora_us + rng.randrange(0, 9_000),
                worker_id=f"gpu-{n % 8}",
            ))
        return records


def _busy_and_loads(records: list[UsageRecord], seq: int) -> tuple[list[BusyRecord], list[AdapterLoadRecord]]:
    """One busy record for the batch (its requests' base + lora time) and a cold start for one adapter in it."""
    first = records[0].created_at
    busy = sum(r.base_us + r.lora_us for r in records)
    busy_record = BusyRecord(worker_id=f"gpu-{seq % 8}", gpu_kind=GPU_KIND, started_at=first + timedelta(microseconds=seq % 997),
                             ended_at=first + timedelta(microseconds=busy + 50_000), busy_us=busy, steps=len(records))
    used = next((r for r in records if r.adapter), None)
    loads = []
    if used is not None and seq % 4 == 0:
        loads.append(AdapterLoadRecord(adapter=used.adapter, adapter_sha256=used.adapter_sha256 or "", tenant_id="platform", tier="disk",  # type: ignore[arg-type]
                                       nbytes=64 << 20, load_us=150_000 + seq % 50_000, worker_id=busy_record.worker_id, created_at=first))
    return [busy_record], loads


def _setup(engine: Engine, fleet: _Fleet, currency: str) -> None:
    with Session(engine) as session, session.begin():
        tiers = list(TIERS)
        session.add_all(Tenant(id=t, display_name=t, tier=tiers[i % len(tiers)]) for i, t in enumerate(fleet.tenants))
    set_gpu_price(engine, GPU_KIND, Decimal("2.40"), date(2025, 1, 1), currency=currency)
    set_gpu_price(engine, GPU_KIND, Decimal("2.10"), date(2026, 1, 16), currency=currency)  # a price cut mid-month: two lines per adapter
    for tier, (inp, out) in TIERS.items():
        set_token_price(engine, tier, inp, out, date(2025, 1, 1), currency=currency)


def bench_ledger(url: str, rows: int, *, script_location: str, json_only: bool = False, batch: int = 2_000) -> dict[str, object]:
    """Run the ledger bench against `url` (its scratch schema migrated with the scripts at `script_location`);
    print a table (unless json_only) and one JSON line; return the figures."""
    assert rows > 0 and batch > 0, (rows, batch)
    console = Console(stderr=True)
    with scratch_database(url) as scratch:
        db.upgrade(scratch, script_location=script_location)
        engine = db.make_engine(scratch)
        try:
            config = LedgerConfig(url=scratch, gpu_kind=GPU_KIND)
            ledger = Ledger(engine, config)
            fleet = _Fleet.make()
            _setup(engine, fleet, config.currency)
            generate_s = insert_s = 0.0
            progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                console=console, disable=json_only)
            with progress:
                task = progress.add_task("inserting usage rows", total=rows)
                for seq, start in enumerate(range(0, rows, batch)):
                    t0 = time.perf_counter()
                    records = fleet.usage(start, min(batch, rows - start))
                    busy, loads = _busy_and_loads(records, seq)
                    t1 = time.perf_counter()
                    written = ledger.record_usage(records)
                    insert_s += time.perf_counter() - t1
                    generate_s += t1 - t0
                    assert written == len(records), (written, len(records))
                    ledger.record_busy(busy)
                    ledger.record_adapter_loads(loads)
                    progress.advance(task, len(records))
            t0 = time.perf_counter()
            with engine.connect() as connection:
                for table in ("usage", "adapter_loads", "gpu_busy"):
                    connection.exec_driver_sql(f"ANALYZE {table}")
                connection.commit()
            analyze_s = time.perf_counter() - t0
            with Session(engine) as session:
                top_tenant, top_rows = session.execute(
                    select(Usage.tenant_id, func.count()).group_by(Usage.tenant_id).order_by(func.count().desc()).limit(1)
                ).one()
            t0 = time.perf_counter()
            invoice = build_invoice(engine, top_tenant, PERIOD, config)
            invoice_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            closed = close_period(engine, config, PERIOD, now=period_end(PERIOD))
            close_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            frozen = build_invoice(engine, top_tenant, PERIOD, config)
            frozen_s = time.perf_counter() - t0
            assert frozen.totals == invoice.totals, "the closed invoice differs from the draft it froze"
        finally:
            engine.dispose()
    figures: dict[str, object] = {
        "backend": make_url(url).get_backend_name(),
        "rows": rows,
        "batch_rows": batch,
        "insert_s": round(insert_s, 3),
        "insert_rows_per_s": round(rows / insert_s),
        "generate_s": round(generate_s, 3),
        "analyze_s": round(analyze_s, 3),
        "invoice_tenant": top_tenant,
        "invoice_tenant_rows": top_rows,
        "invoice_lines": len(invoice.lines),
        "invoice_s": round(invoice_s, 3),
        "close_s": round(close_s, 3),
        "closed_invoices": len(closed),
        "closed_invoice_read_s": round(frozen_s, 3),
    }
    if not json_only:
        width = max(map(len, figures))
        for key, value in figures.items():
            print(f"{key:<{width}}  {value}")
    print(json.dumps(figures), flush=True)
    return figures
