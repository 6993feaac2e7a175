"""A month's reconciliation: the GPU time the workers measured against the time the invoices attribute.

Three identities, each exact in integer microseconds; whatever does not fit is a named residue line.

  busy + carried_in = base + lora + billed_later + redelivered_work + unbilled_work + carried_out + unexplained_busy
  loads     = cold_start_spread + unused_loads
  invoiced  = base + lora + routing_decisions - kv_credit + cold_start_spread + late_usage + invoice_difference

- busy: the busy records started in P (each the sum of its engine steps' measured time); idle time (each
  worker's wall span less its busy time) is shown beside it, measured and charged to nobody.
- base, lora: of P's own requests billed on P's invoices. billed_later: of P's requests that arrived after
  their invoice was closed, billed on a later month as adjustment lines. late_usage: base + LoRA of
  earlier months' requests billed on P's invoices (their busy time is their own month's).
- redelivered_work: copies of a request that ran again after its row was written (billing.models.
  UsageRedelivery): measured in busy, billed to nobody.
- unbilled_work: what the workers named on their busy records as taken by requests no usage row bills: the
  requests an engine process was running when it died (answered engine_failed, charged nothing) and jobs
  abandoned on a partition revoke (their new owner runs and bills them).
- carried_out: of P's busy time, what requests billed in a later month took (a request's month is the instant its
  GPU work finished): those still running when P's last busy record of a worker ended, and those that finished
  between P's end and that record's end, as the worker named it (gpu_busy.carried_us). carried_in: the same time
  of earlier months' records owed by P (gpu_busy.carried_to).
- unexplained_busy: what is left: work whose usage rows never reached the ledger (a worker killed outright, a
  record lost), or a worker clock that stepped back over a month's end.
- loads: adapter load time billed to P (its own loads, and later-arriving loads of months whose spread
  was frozen). unused_loads: loads of adapters no request billed to P used.
- routing_decisions and kv_credit (billing/credit.py) are per-request amounts on top of busy time.
- invoice_difference: P's invoices against the rows they bill; zero unless an invoice was closed under
  an earlier rule (a closed invoice is never recomputed).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, func, select
from sqlalchemy.orm import Session

from billing.billable import check_billable_period
from billing.config import LedgerConfig
from billing.conservation import period_conservation
from billing.cost import us_to_ms
from billing.credit import kv_credit_sql
from billing.db import read_snapshot
from billing.invoice import period_invoices
from billing.models import Busy, Usage, UsageRedelivery
from billing.periods import check_period
from billing.sre import worker_times


@dataclass(frozen=True)
class ReconcileLine:
    item: str
    kind: str  # "measured" | "attributed" | "residue"
    us: int  # signed: the KV credit is negative
    note: str


@dataclass(frozen=True)
class ReconcileReport:
    period: str
    invoices: int
    closed_invoices: int
    lines: tuple[ReconcileLine, ...]

    def us(self, item: str) -> int:
        return next(line.us for line in self.lines if line.item == item)

    @property
    def residue_us(self) -> int:
        """The named residue: every residue line's microseconds (unexplained and differences included)."""
        return sum(line.us for line in self.lines if line.kind == "residue")

    @property
    def conserved(self) -> bool:
        """Every microsecond explained: nothing unexplained, invoices equal to their rows."""
        return self.us("unexplained_busy") == 0 and self.us("invoice_difference") == 0


def _int(value: object) -> int:
    return int(value or 0)  # type: ignore[call-overload]  # SUM over no row is NULL; over bigint on PostgreSQL, numeric


def _sums(session: Session, *columns: object, where: object) -> list[int]:
    row = session.execute(select(*(func.sum(c) for c in columns)).where(where)).one()  # type: ignore[arg-type]
    return [_int(v) for v in row]


def reconcile_report(db: Engine | Session, period: str, config: LedgerConfig, *, now: datetime | None = None) -> ReconcileReport:
    """The reconciliation of `period` (module docstring); a period that cannot be billed is refused."""
    check_period(period)
    session = db if isinstance(db, Session) else read_snapshot(db)
    try:
        check_billable_period(session, period, now)
        busy, unbilled, carried_out = _sums(session, Busy.busy_us, Busy.unbilled_us, Busy.carried_us, where=Busy.period == period)
        carried_in, = _sums(session, Busy.carried_us, where=Busy.carried_to == period)
        idle = sum(int(w.idle_s * 1_000_000) for w in worker_times(session, period))
        base, lora = _sums(session, Usage.base_us, Usage.lora_us, where=(Usage.period == period) & (Usage.invoice_period == period))
        later_base, later_lora = _sums(session, Usage.base_us, Usage.lora_us, where=(Usage.period == period) & (Usage.invoice_period != period))
        late_base, late_lora = _sums(session, Usage.base_us, Usage.lora_us, where=(Usage.invoice_period == period) & (Usage.period != period))
        routing, credit = _sums(session, Usage.routing_us, kv_credit_sql(), where=Usage.invoice_period == period)
        redelivered, = _sums(session, UsageRedelivery.base_us + UsageRedelivery.lora_us, where=UsageRedelivery.period == period)
        cons = period_conservation(session, period, config)
        invoices = period_invoices(session, period, config, now=now)
        invoiced = sum(i.gpu_us for i in invoices)
        cold = cons.cold_start_us
        late = late_base + late_lora
        billed_later = later_base + later_lora
        lines = (
            ReconcileLine("gpu_busy", "measured", busy, "busy records started in the month: the engine steps' measured time"),
            ReconcileLine("carried_in", "measured", carried_in, "busy time of earlier months' records that requests billed in this month took"),
            ReconcileLine("gpu_idle", "measured", idle, "each worker's wall span less its busy time: charged to nobody"),
            ReconcileLine("adapter_loads", "measured", cons.load_us + cons.unbilled_load_us, "adapter load time billed to the month's cold-start spread"),
            ReconcileLine("base", "attributed", base, "the month's requests on its invoices: token share of each step's base time"),
            ReconcileLine("lora", "attributed", lora, "the month's requests on its invoices: token share of each step's LoRA time"),
            ReconcileLine("routing_decisions", "attributed", routing, "routing decision time of the requests billed here (not GPU busy time)"),
            ReconcileLine("kv_credit", "attributed", -credit, "cached prompt tokens, capped at what computing them would have been charged"),
            ReconcileLine("cold_start_spread", "attributed", cold, "load time spread over the requests of the loaded adapter, by tokens"),
            ReconcileLine("late_usage", "attributed", late, "base + LoRA of earlier months' requests billed here as adjustment lines"),
            ReconcileLine("invoiced", "attributed", invoiced, "the month's invoices: base + lora + routing - kv credit + cold start + late usage"),
            ReconcileLine("billed_later", "residue", billed_later, "the month's requests that arrived after their invoice closed: on a later month's adjustment lines"),
            ReconcileLine("redelivered_work", "residue", redelivered, "copies that ran again after the request's row was written: measured, billed to nobody"),
            ReconcileLine("unused_loads", "residue", cons.unbilled_load_us, "loads of adapters that no request billed to the month used"),
            ReconcileLine("unbilled_work", "residue", unbilled, "requests an engine crash failed, or a revoke abandoned to their new owner: measured, billed to nobody"),
            ReconcileLine("carried_out", "residue", carried_out, "the month's busy time that requests finishing after it took: billed in a later month"),
            ReconcileLine("unexplained_busy", "residue", busy + carried_in - base - lora - billed_later - redelivered - unbilled - carried_out,
                          "busy time no row explains: rows that never reached the ledger (a worker killed outright)"),
            ReconcileLine("invoice_difference", "residue", invoiced - (base + lora + routing - credit + cold + late),
                          "invoices against the rows they bill: invoices closed under an earlier rule"),
        )
        return ReconcileReport(period, len(invoices), sum(i.status == "closed" for i in invoices), lines)
    finally:
        if session is not db:
            session.close()


def reconcile_summary(report: ReconcileReport) -> dict[str, object]:
    """The report's summary figures (what every format carries above its table)."""
    return {
        "invoices": report.invoices, "closed_invoices": report.closed_invoices,
        "busy_ms": us_to_ms(report.us("gpu_busy")), "invoiced_ms": us_to_ms(report.us("invoiced")),
        "residue_ms": us_to_ms(report.residue_us), "unexplained_ms": us_to_ms(report.us("unexplained_busy")),
        "conserved": report.conserved,
    }
