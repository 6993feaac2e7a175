"""The SRE report's latency percentiles: ranked in the database, equal to nearest_rank over the rows, read without
fetching every request (a month's report held each request's two latencies in Python lists)."""

from __future__ import annotations

import random
import tracemalloc
from datetime import datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine

from billing.config import LedgerConfig
from billing.ledger import Ledger
from billing.sre import PERCENTILES, nearest_rank, sre_report
from tests.test_ledger import usage_record

AT = datetime(2026, 10, 3, 12, tzinfo=timezone.utc)
SHA = "22" * 32


def _ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url)))


def test_percentiles_equal_nearest_rank_over_the_rows(engine: Engine) -> None:
    """Adapters of 1, 2, 3, 99, 100, 101 and 250 succeeded requests (ties, zeros and 2^48 - 1 among the values), the base
    model's, failed requests left out and another month's rows too: every p50/p95/p99 of total and first-token time is
    nearest_rank of that adapter's values."""
    rnd = random.Random(7)
    records, expected = [], {}
    for n in (1, 2, 3, 99, 100, 101, 250):
        adapter = None if n == 3 else f"a{n}@1"
        totals = [rnd.choice((0, 5, 5, rnd.randrange(10**9), 2**48 - 1)) for _ in range(n)]
        ttfts = [rnd.randrange(10**6) for _ in range(n)]
        records += [usage_record(f"{n}-{i}", created_at=AT, adapter=adapter, adapter_sha256=adapter and SHA, total_us=t, ttft_us=f)
                    for i, (t, f) in enumerate(zip(totals, ttfts))]
        records += [usage_record(f"{n}-failed-{i}", created_at=AT, adapter=adapter, adapter_sha256=adapter and SHA, status="failed",
                                 total_us=2**48 - 1, ttft_us=0) for i in range(5)]
        records.append(usage_record(f"{n}-later", created_at=AT + timedelta(days=40), adapter=adapter, adapter_sha256=adapter and SHA,
                                    total_us=2**48 - 1))
        expected[adapter or "base"] = ([nearest_rank(sorted(totals), p) for p in PERCENTILES], [nearest_rank(sorted(ttfts), p) for p in PERCENTILES])
    records.append(usage_record("only-failed", created_at=AT, adapter="f@1", adapter_sha256=SHA, status="failed", total_us=9))
    expected["f@1"] = ([0] * 3, [0] * 3)
    _ledger(engine).record_usage(records)
    report = sre_report(engine, "2026-10", now=AT + timedelta(days=60))
    got = {a.adapter: ([int(ms * 1000) for ms in a.total_ms], [int(ms * 1000) for ms in a.ttft_ms]) for a in report.adapters}
    assert got == expected


def test_the_report_does_not_hold_every_request(engine: Engine) -> None:
    """60,000 requests of one month: the report's Python peak stays under 3 MB (fetching every row's two latencies and
    sorting them in Python peaked at 18.5 MB here, and grew with the month)."""
    if engine.dialect.name != "sqlite":
        pytest.skip("the rows are ranked alike on PostgreSQL; one backend measures the memory")
    ledger = _ledger(engine)
    for start in range(0, 60_000, 20_000):
        ledger.record_usage([usage_record(f"r{i}", created_at=AT, adapter=f"a{i % 7}@1", adapter_sha256=SHA, total_us=i * 7919 % 10**6,
                                          ttft_us=i % 1000, base_us=10) for i in range(start, start + 20_000)])
    tracemalloc.start()
    try:
        report = sre_report(engine, "2026-10", now=AT + timedelta(days=60))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(a.requests for a in report.adapters) == 60_000
    assert peak < 3 * 2**20, f"peak {peak / 2**20:.1f} MB"
