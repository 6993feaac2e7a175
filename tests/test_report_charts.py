"""The reports' charts with more rows than a chart can show: they draw the rows that matter most and say so."""

from __future__ import annotations

from decimal import Decimal

import pytest

from billing.charts import MAX_BARS, _most, finance_charts, sre_charts
from billing.finance import FinanceReport, TenantFinance
from billing.sre import SreReport, WorkerSre

D0 = Decimal(0)


def _tenant(i: int) -> TenantFinance:
    return TenantFinance(f"t{i:03d}", "standard", "draft", 1, Decimal(i), D0, D0, D0, Decimal(i) / 1000, D0, False, 1)


def _worker(i: int, idle_s: int) -> WorkerSre:
    return WorkerSre(f"w{i}", "h100", 1, 1, Decimal(10 - idle_s), Decimal(10), Decimal(idle_s), D0)


@pytest.mark.parametrize("n, note", [
    (0, None),
    (1, ""),
    (MAX_BARS, ""),
    (MAX_BARS + 1, f" (the {MAX_BARS} of {MAX_BARS + 1} tenants with the most GPU time; the table holds every one)"),
    (300, f" (the {MAX_BARS} of 300 tenants with the most GPU time; the table holds every one)"),
])
def test_a_finance_chart_says_when_it_leaves_tenants_out(n, note):
    """A chart of 25 tenants out of 300 was captioned "GPU share vs revenue share" as if it held them all."""
    report = FinanceReport("2026-10", "USD", Decimal("1.5"), tuple(_tenant(i) for i in range(n)), n, D0, D0, D0, D0)
    titles = [title for title, _ in finance_charts(report)]
    if note is None:
        assert titles == ["GPU share vs revenue share"]
    else:
        assert titles == ["GPU share vs revenue share" + note, "Margin per tenant" + note]


def test_the_worker_chart_shows_the_idlest_workers_and_says_so():
    """Of 80 workers the chart drew the first 25 in the report's order (by id: w0, w1, w10 ... w30), leaving out the
    idlest, and its caption did not say any was left out; it now draws the 25 with the most idle time and says so."""
    workers = tuple(_worker(i, idle_s=i % 10) for i in range(80))  # w9, w19, ... w79 are the idlest (9 s)
    report = SreReport("2026-10", (), workers, D0, D0, D0, D0, D0)
    titles = [title for title, _ in sre_charts(report)]
    assert titles[-1] == f"GPU busy and idle (the {MAX_BARS} of 80 workers with the most idle time; the table holds every one)"
    chosen, _ = _most(workers, lambda w: w.idle_s, "workers", "idle time")
    assert sorted(w.idle_s for w in chosen) == sorted(w.idle_s for w in workers)[-MAX_BARS:]
    assert {f"w{i}" for i in range(9, 80, 10)} <= {w.worker_id for w in chosen}
