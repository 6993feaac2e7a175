"""Per-period conservation: what the ledger measured against what it attributed and billed.

For a period P (a UTC month), exactly:

  1. attributed_us == busy_us, where attributed_us is the sum of base_us + lora_us over the usage rows
     created in P and busy_us the sum of busy_us over the GPU busy records started in P. Each step's
     time is split over its requests to the microsecond by the engine (engine/timing.py; billing
     takes the sums as plain records and imports nothing of it) and a busy record sums the same
     steps, so the two agree whenever each engine batch's busy record and its requests fall in the
     same month. A request's month is the instant its GPU work finished, so the busy time that requests
     running over a month's end took in the old month is carried to the new one: `carried_out_us` of the
     old month, `carried_in_us` of the new (gpu_busy.carried_us and carried_to), and `unattributed_us`
     (busy + carried in - carried out - attributed) shows what is left.
  2. cold_start_us == load_us, where cold_start_us is the sum of the cold-start time on every invoice
     of P and load_us the sum of load_us over the loads billed to P whose adapter (name@version and
     content) has at least one request billed to P -- once P's spread is frozen (its first close), at
     least one share in that frozen spread: a request that arrives later, for an adapter nobody had
     used, finds the spread already made. Loads of adapters nobody used in P are billed to nobody and
     are reported as `unbilled_load_us`.

The routing decision time and the KV credit are per-request amounts on top of the busy time, not
part of it, so an invoice's gpu_ms is busy + load + decisions - credits, not busy + load.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.config import LedgerConfig
from billing.db import read_snapshot
from billing.invoice import period_invoices
from billing.models import AdapterLoad, BillingPeriod, Busy, ColdStartShare, Usage
from billing.periods import check_period


@dataclass(frozen=True)
class Conservation:
    period: str
    attributed_us: int  # sum of base_us + lora_us of the usage created in the period
    busy_us: int  # sum of busy_us of the busy records started in the period
    load_us: int  # load time billed to the period, of adapters with requests billed to it
    unbilled_load_us: int  # load time billed to the period, of adapters without any
    cold_start_us: int  # cold-start time on the period's invoices
    unbilled_us: int = 0  # busy time the workers named as taken by requests no usage row bills (gpu_busy.unbilled_us)
    carried_in_us: int = 0  # busy time of earlier months that requests of this one took (gpu_busy.carried_to)
    carried_out_us: int = 0  # busy time of this month that requests of later ones took (gpu_busy.carried_us)

    @property
    def unattributed_us(self) -> int:
        return self.busy_us + self.carried_in_us - self.carried_out_us - self.attributed_us


def _int(value: object) -> int:
    return int(value or 0)  # type: ignore[call-overload]  # SUM over no row is NULL; over bigint on PostgreSQL, numeric


def period_conservation(db: Engine | Session, period: str, config: LedgerConfig) -> Conservation:
    """Measured and attributed totals of `period`; see the module docstring for what must be equal."""
    check_period(period)
    session = db if isinstance(db, Session) else read_snapshot(db)
    try:
        attributed = session.scalar(select(func.sum(Usage.base_us + Usage.lora_us)).where(Usage.period == period))
        busy, unbilled, carried_out = session.execute(
            select(func.sum(Busy.busy_us), func.sum(Busy.unbilled_us), func.sum(Busy.carried_us)).where(Busy.period == period)).one()
        carried_in = session.scalar(select(func.sum(Busy.carried_us)).where(Busy.carried_to == period))
        loads = session.execute(
            select(AdapterLoad.adapter, AdapterLoad.adapter_sha256, func.sum(AdapterLoad.load_us))
            .where(AdapterLoad.invoice_period == period)
            .group_by(AdapterLoad.adapter, AdapterLoad.adapter_sha256)
        ).all()
        if session.scalar(select(BillingPeriod.spread_frozen_at).where(BillingPeriod.period == period)) is not None:
            # Frozen at the first close: a load is billed when the frozen spread gave it out, whoever used the adapter since.
            frozen = select(ColdStartShare.adapter, ColdStartShare.adapter_sha256).where(ColdStartShare.period == period).distinct()
            used = {(adapter, sha) for adapter, sha in session.execute(frozen)}
        else:
            used = {
                (adapter, sha)
                for adapter, sha in session.execute(
                    select(Usage.adapter, Usage.adapter_sha256).where(Usage.invoice_period == period, Usage.adapter.is_not(None)).distinct()
                )
            }
        billed = sum(_int(us) for adapter, sha, us in loads if (adapter, sha) in used or (adapter, None) in used)
        total_load = sum(_int(us) for *_, us in loads)
        cold = sum(int(invoice.totals.cold_start_ms * 1000) for invoice in period_invoices(session, period, config))
        return Conservation(period, _int(attributed), _int(busy), billed, total_load - billed, cold, _int(unbilled),
                            _int(carried_in), _int(carried_out))
    finally:
        if session is not db:
            session.close()
