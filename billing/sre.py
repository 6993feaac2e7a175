"""The SRE report of a period: where the GPU's time went, per adapter and per worker.

Per adapter (requests created in the period; "base" for the base model): requests, GPU seconds by
component (base, LoRA, routing decision, KV credit as billed and as measured, cold start), routing overhead as a share of the
GPU time (decision + LoRA over base + LoRA + decision), KV savings, cold starts (loads in the period,
how many and how long) and latency percentiles of total and first-token time. Per worker, from its
busy records: busy time, the wall span from its first record's start to its last one's end, and the
idle time between (span - busy), which no request is charged. The totals compare the busy time with
the attributed time (billing/conservation.py): `unattributed_s`, what is left once the redelivered, unbilled and
carried work that reconcile names is taken out too (busy time carried over a month's end to the requests that
finished after it), should be zero.

Percentiles are nearest-rank (the smallest value with at least p% of the values at or below it; nearest_rank),
ranked in the database by a window (row_number over each adapter's rows), so both backends give the same answer
and only the rows at the ranks are read.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal

from sqlalchemy import Engine, case, func, select
from sqlalchemy.orm import Session

from billing.billable import check_billable_period
from billing.cost import us_to_ms
from billing.credit import kv_credit_sql
from billing.db import read_snapshot
from billing.models import AdapterLoad, Busy, Usage, UsageRedelivery
from billing.periods import check_period
from billing.tally import BASE_MODEL

PERCENTILES = (50, 95, 99)
_MICROSECOND = timedelta(microseconds=1)
_SHARE_QUANTUM = Decimal("0.0001")


def us_to_s(us: int) -> Decimal:
    """Integer microseconds as seconds with exactly six places."""
    return (Decimal(us) / 1_000_000).quantize(Decimal("0.000001"))


def share(part: int, whole: int) -> Decimal:
    return (Decimal(part) / whole).quantize(_SHARE_QUANTUM, rounding=ROUND_HALF_EVEN) if whole else Decimal(0).quantize(_SHARE_QUANTUM)


def nearest_rank(sorted_values: list[int], p: int) -> int:
    """The p-th percentile by nearest rank of ascending `sorted_values` (0 for none)."""
    if not sorted_values:
        return 0
    rank = -(-p * len(sorted_values) // 100)  # ceil(p * n / 100), in integers
    return sorted_values[max(rank, 1) - 1]


@dataclass(frozen=True)
class AdapterSre:
    adapter: str
    requests: int
    failed: int
    base_s: Decimal
    lora_s: Decimal
    routing_s: Decimal  # the routing decisions
    kv_saved_s: Decimal  # the KV credit as billed (billing/credit.py)
    kv_measured_s: Decimal  # the saving the engine measured, before billing's cap
    cold_start_s: Decimal  # the adapter's load time in the period
    gpu_s: Decimal  # base + lora + routing - kv_saved + cold_start
    routing_overhead: Decimal  # (routing + lora) / (base + lora + routing), 0..1
    cached_tokens: int
    cold_starts: int
    total_ms: tuple[Decimal, ...]  # p50, p95, p99
    ttft_ms: tuple[Decimal, ...]


@dataclass(frozen=True)
class WorkerSre:
    worker_id: str
    gpu_kinds: str
    records: int
    steps: int
    busy_s: Decimal
    span_s: Decimal
    idle_s: Decimal
    busy_share: Decimal


@dataclass(frozen=True)
class SreReport:
    period: str
    adapters: tuple[AdapterSre, ...]
    workers: tuple[WorkerSre, ...]
    busy_s: Decimal
    attributed_s: Decimal  # base + lora of the period's requests
    unattributed_s: Decimal  # busy + carried in - carried out - attributed - redelivered and unbilled work (as reconcile): zero when every step's time is accounted
    idle_s: Decimal
    unused_load_s: Decimal  # load time of adapters with no request in the period


def _adapter_sums(session: Session, period: str) -> dict[str, dict[str, int]]:
    statement = (
        select(
            Usage.adapter,
            func.count().label("requests"),
            func.sum(case((Usage.status == "failed", 1), else_=0)).label("failed"),
            func.sum(Usage.base_us).label("base_us"),
            func.sum(Usage.lora_us).label("lora_us"),
            func.sum(Usage.routing_us).label("routing_us"),
            func.sum(kv_credit_sql()).label("kv_saved_us"),
            func.sum(Usage.kv_saved_us).label("kv_measured_us"),
            func.sum(Usage.cached_tokens).label("cached_tokens"),
        )
        .where(Usage.period == period)
        .group_by(Usage.adapter)
    )
    return {row.adapter or BASE_MODEL: {k: int(v) for k, v in row._mapping.items() if k != "adapter"} for row in session.execute(statement)}


def _latencies(session: Session, period: str) -> dict[str, tuple[list[int], list[int]]]:
    """Per adapter, (total, ttft) microseconds at PERCENTILES of its succeeded requests of `period`, by nearest rank.

    Ranked in the database (a window over each adapter's rows; both backends, exact integers): only the rows at the
    ranks come back, so memory does not grow with the month, where every request's two latencies were fetched into
    Python lists and sorted there (about 50 MB of a 500,000-request month's report)."""
    out: dict[str, tuple[list[int], list[int]]] = defaultdict(lambda: ([0] * len(PERCENTILES), [0] * len(PERCENTILES)))
    for which, column in enumerate((Usage.total_us, Usage.ttft_us)):
        ranked = (
            select(Usage.adapter.label("adapter"), column.label("value"),
                   func.row_number().over(partition_by=Usage.adapter, order_by=column).label("rank"),
                   func.count().over(partition_by=Usage.adapter).label("n"))
            .where(Usage.period == period, Usage.status == "succeeded")
            .subquery()
        )
        ranks = [(p * ranked.c.n + 99) // 100 for p in PERCENTILES]  # ceil(p * n / 100), in integers (nearest_rank)
        statement = select(ranked.c.adapter, ranked.c.rank, ranked.c.n, ranked.c.value).where(ranked.c.rank.in_(ranks))
        for adapter, rank, n, value in session.execute(statement):
            values = out[adapter or BASE_MODEL][which]
            for i, p in enumerate(PERCENTILES):
                if max(-(-p * int(n) // 100), 1) == rank:
                    values[i] = int(value)
    return out


def worker_times(session: Session, period: str) -> list[WorkerSre]:
    """Per worker of `period`'s busy records: busy time, wall span (first start to last end) and idle time between."""
    statement = (
        select(
            Busy.worker_id, func.count(), func.sum(Busy.steps), func.sum(Busy.busy_us), func.min(Busy.started_at), func.max(Busy.ended_at),
        )
        .where(Busy.period == period)
        .group_by(Busy.worker_id)
        .order_by(Busy.worker_id)
    )
    kinds: dict[str, set[str]] = defaultdict(set)
    for worker, kind in session.execute(select(Busy.worker_id, Busy.gpu_kind).where(Busy.period == period).distinct()):
        kinds[worker].add(kind)
    workers = []
    for worker, records, steps, busy_us, first, last in session.execute(statement):
        span_us = (last - first) // _MICROSECOND
        busy_us = int(busy_us)
        workers.append(WorkerSre(worker, ",".join(sorted(kinds[worker])), records, int(steps), us_to_s(busy_us), us_to_s(span_us),
                                 us_to_s(span_us - busy_us), share(busy_us, span_us)))
    return workers


def sre_report(db: Engine | Session, period: str, *, now: datetime | None = None) -> SreReport:
    """The SRE report of `period` (requests, loads and busy records by their own UTC month); a period that cannot be billed is refused."""
    check_period(period)
    session = db if isinstance(db, Session) else read_snapshot(db)
    try:
        check_billable_period(session, period, now)
        sums = _adapter_sums(session, period)
        latencies = _latencies(session, period)
        loads = {
            adapter: (int(n), int(us))
            for adapter, n, us in session.execute(
                select(AdapterLoad.adapter, func.count(), func.sum(AdapterLoad.load_us)).where(AdapterLoad.period == period).group_by(AdapterLoad.adapter)
            )
        }
        adapters = []
        for adapter in sorted(sums, key=lambda a: (a != BASE_MODEL, a)):
            s = sums[adapter]
            cold_starts, cold_us = loads.get(adapter, (0, 0))
            gpu_us = s["base_us"] + s["lora_us"] + s["routing_us"] - s["kv_saved_us"] + cold_us
            total, ttft = latencies.get(adapter, ([0] * len(PERCENTILES), [0] * len(PERCENTILES)))
            adapters.append(AdapterSre(
                adapter=adapter, requests=s["requests"], failed=s["failed"], base_s=us_to_s(s["base_us"]), lora_s=us_to_s(s["lora_us"]),
                routing_s=us_to_s(s["routing_us"]), kv_saved_s=us_to_s(s["kv_saved_us"]),
                kv_measured_s=us_to_s(s["kv_measured_us"]), cold_start_s=us_to_s(cold_us), gpu_s=us_to_s(gpu_us),
                routing_overhead=share(s["routing_us"] + s["lora_us"], s["base_us"] + s["lora_us"] + s["routing_us"]),
                cached_tokens=s["cached_tokens"], cold_starts=cold_starts,
                total_ms=tuple(map(us_to_ms, total)), ttft_ms=tuple(map(us_to_ms, ttft)),
            ))
        workers = worker_times(session, period)
        busy_us, unbilled_us, carried_out_us = (int(v or 0) for v in session.execute(
            select(func.sum(Busy.busy_us), func.sum(Busy.unbilled_us), func.sum(Busy.carried_us)).where(Busy.period == period)).one())
        carried_in_us = int(session.scalar(select(func.sum(Busy.carried_us)).where(Busy.carried_to == period)) or 0)
        attributed_us = sum(s["base_us"] + s["lora_us"] for s in sums.values())
        # A rerun of a request that already had its row: measured in busy, billed to nobody (billing/reconcile.py).
        redelivered_us = int(session.scalar(select(func.sum(UsageRedelivery.base_us + UsageRedelivery.lora_us))
                                            .where(UsageRedelivery.period == period)) or 0)
        unused_us = sum(us for adapter, (_, us) in loads.items() if adapter not in sums)
        return SreReport(
            period=period, adapters=tuple(adapters), workers=tuple(workers), busy_s=us_to_s(busy_us), attributed_s=us_to_s(attributed_us),
            unattributed_s=us_to_s(busy_us + carried_in_us - carried_out_us - attributed_us - redelivered_us - unbilled_us), idle_s=sum((w.idle_s for w in workers), Decimal("0.000000")),
            unused_load_s=us_to_s(unused_us),
        )
    finally:
        if session is not db:
            session.close()
