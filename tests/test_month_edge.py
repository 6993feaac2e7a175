"""Work that straddles midnight UTC at a month's end: which month bills it, at which prices, and how reconcile agrees.

A request's month and prices are those of the instant its GPU work finished (the worker got its result), not the instant
the worker received the job: a job received at 23:59:59 on January 31 that runs past midnight is a February request at
February's prices. A busy record is its started_at's month, so the busy time of requests still running when a month
ends (and of those that finished between midnight and the record's end) is measured in the old month and billed in the
new one: the worker names it on the record (gpu_busy.carried_us, revision 0011), and reconcile moves it from the old
month to the month of the record's end. Before, a busy month boundary showed unexplained_busy in both months.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from decimal import Decimal
from types import SimpleNamespace

from sqlalchemy import Engine, select

from billing.config import LedgerConfig
from billing.conservation import period_conservation
from billing.cost import gpu_cost
from billing.db import session_factory
from billing.invoice import build_invoice
from billing.ledger import Ledger
from billing.models import Usage
from billing.prices import set_gpu_price, set_token_price
from billing.reconcile import reconcile_report
from billing.sre import sre_report
from consumer.feeder import EngineFeeder
from consumer.schemas import Job
from engine.api import GenerationRequest, GenerationResult, RequestTimings

CONFIG = LedgerConfig(gpu_price_per_hour=Decimal("7.20"), gpu_kind="h100")
MIDNIGHT = datetime(2027, 2, 1, tzinfo=UTC)
LATER = datetime(2027, 4, 1, tzinfo=UTC)


def _at(us_from_midnight: int) -> datetime:
    return MIDNIGHT + timedelta(microseconds=us_from_midnight)


class _Clock:
    def __init__(self, now: datetime):
        self.now = now

    def __call__(self) -> datetime:
        return self.now


class _Engine:
    """An engine host whose requests finish at once with the time the test gives them, and whose GPU time it sets."""

    def __init__(self):
        self.charged: dict[str, tuple[int, int]] = {}  # request_id -> (base_us, lora_us)
        self.gpu = ([], 0, 0, MIDNIGHT, 0)

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        base_us, lora_us = self.charged[req.request_id]
        return GenerationResult(request_id=req.request_id, adapter_key=None, tenant_id=req.tenant_id, output_ids=[7, 8],
                                prompt_tokens=2, finish_reason="length", timings=RequestTimings(base_us=base_us, lora_us=lora_us))

    async def pop_gpu_time(self):
        return self.gpu


def _item(request_id: str, received_at: datetime) -> SimpleNamespace:
    job = Job(request_id=request_id, tenant_id="acme", input_ids=[1, 2], max_new_tokens=2)
    return SimpleNamespace(job=job, route=SimpleNamespace(view=None, label="base", routing_us=0), stamps=None,
                           abandoned=False, received_mono_us=0, received_at=received_at, tp=None, offset=0, epoch=None,
                           tier="standard")


async def _midnight_run(engine: Engine) -> Ledger:
    """Three jobs received in January's last second: r1 finishes before midnight, r2 after it (before the busy record
    that crosses midnight ends), r3 is still running when that record ends and finishes in February's first record."""
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    stub, clock = _Engine(), _Clock(_at(-1_000_000))
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100", clock=clock)
    assert feeder._since == _at(-1_000_000)
    stub.charged = {"r1": (300, 0), "r2": (800, 200), "r3": (700, 200)}
    rows, busy = [], []

    async def finish(request_id: str, received_us: int, finished_us: int) -> None:
        clock.now = _at(finished_us)
        served = await feeder.serve(_item(request_id, _at(received_us)), "standard")
        rows.append(served.outcome.usage)

    async def drain(busy_us: int, steps: int, clock_us: int) -> None:
        stub.gpu = ([], busy_us, steps, _at(clock_us), 0)
        clock.now = _at(clock_us)
        busy.append((await feeder.drain_gpu_time())[1])

    await finish("r1", -900_000, -600_000)
    await finish("r2", -500_000, 200_000)
    # 300 (r1) + 1,000 (r2) + 400 of r3 so far: a record begun in January
    await drain(1_700, 9, 300_000)
    await finish("r3", -100_000, 600_000)  # its other 500 µs run in February
    await drain(500, 3, 1_000_000)
    ledger.record_usage(rows)
    ledger.record_busy(busy)
    assert [b.started_at.month for b in busy] == [1, 2]
    return ledger


async def test_work_straddling_midnight_reconciles_in_both_months(engine: Engine) -> None:
    """Conservation at a month boundary: each month's busy time, less what requests billed in the next month took of
    it, plus what the previous month's records measured of this month's requests, is what its rows bill."""
    await _midnight_run(engine)
    january = reconcile_report(engine, "2027-01", CONFIG, now=LATER)
    february = reconcile_report(engine, "2027-02", CONFIG, now=LATER)
    assert (january.us("gpu_busy"), january.us("base") + january.us("lora")) == (1_700, 300)
    assert (february.us("gpu_busy"), february.us("base") + february.us("lora")) == (500, 1_900)
    assert (january.us("unexplained_busy"), february.us("unexplained_busy")) == (0, 0)
    assert january.us("carried_out") == february.us("carried_in") == 1_400
    assert january.conserved and february.conserved
    assert sre_report(engine, "2027-01").unattributed_s == sre_report(engine, "2027-02").unattributed_s == 0
    assert period_conservation(engine, "2027-01", CONFIG).unattributed_us == period_conservation(engine, "2027-02", CONFIG).unattributed_us == 0


async def test_a_request_is_billed_in_the_month_and_at_the_prices_of_when_it_ran(engine: Engine) -> None:
    """r2 and r3 were received in January and ran past midnight: February requests, at February's GPU and token
    prices; r1, which finished in January, keeps January's."""
    set_gpu_price(engine, "h100", Decimal("2.00"), date(2027, 1, 1), currency="USD")
    set_gpu_price(engine, "h100", Decimal("3.60"), date(2027, 2, 1), currency="USD")
    set_token_price(engine, "standard", Decimal("0.10"), Decimal("0.30"), date(2027, 1, 1), currency="USD")
    set_token_price(engine, "standard", Decimal("1.00"), Decimal("3.00"), date(2027, 2, 1), currency="USD")
    await _midnight_run(engine)
    with session_factory(engine)() as session:
        rows = {u.request_id: u for u in session.scalars(select(Usage))}
    assert {key: (u.period, u.invoice_period) for key, u in rows.items()} == {
        "r1": ("2027-01", "2027-01"), "r2": ("2027-02", "2027-02"), "r3": ("2027-02", "2027-02")}
    assert rows["r1"].cost == gpu_cost(300, Decimal("2.00"))
    assert rows["r2"].cost == gpu_cost(1_000, Decimal("3.60"))
    january = build_invoice(engine, "acme", "2027-01", CONFIG, now=LATER)
    february = build_invoice(engine, "acme", "2027-02", CONFIG, now=LATER)
    assert (january.totals.requests, february.totals.requests) == (1, 2)
    assert [line.gpu_price_per_hour for line in february.lines] == [Decimal("3.60")]
    # 2 requests x (2 input at 1.00 + 2 output at 3.00 per million)
    assert february.totals.revenue == Decimal("0.000016")


async def test_a_month_end_with_no_step_still_carries_what_is_running() -> None:
    """A request preempted (or waiting) over midnight: no step in the interval that crosses it, yet 400 µs of January
    busy time is its; a record of its own, 0 µs busy, carries them, so January's rows and busy time still agree."""
    stub, clock = _Engine(), _Clock(_at(-1_000_000))
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100", clock=clock)
    stub.gpu = ([], 400, 2, _at(-500_000), 0)
    _, first = await feeder.drain_gpu_time()
    assert (first.busy_us, first.carried_us) == (400, 0)
    stub.gpu = ([], 0, 0, _at(100_000), 0)
    _, crossing = await feeder.drain_gpu_time()
    assert crossing is not None and (crossing.busy_us, crossing.steps, crossing.carried_us) == (0, 0, 400)
    assert crossing.started_at == first.ended_at and crossing.ended_at.month == 2


def test_the_ledger_refuses_a_carry_on_a_record_within_one_month(engine: Engine) -> None:
    from billing.errors import LedgerRecordError
    from billing.records import BusyRecord
    import pytest

    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    with pytest.raises(LedgerRecordError, match="carried_us"):
        ledger.record_busy([BusyRecord("w0", "h100", _at(1), _at(2), 1, 1, carried_us=5)])
    with pytest.raises(LedgerRecordError, match="carried_us"):
        ledger.record_busy([BusyRecord("w0", "h100", _at(-2), _at(2), 1, 1, carried_us=-5)])


async def test_a_record_pushed_past_midnight_by_its_steps_carries_and_later_rows_are_february_rows() -> None:
    """A record whose steps pass its span ends that much later (tests/test_unbilled_work.py): ended past midnight, it is
    January's last and carries what January's rows do not bill; a result that then reaches the worker with its clock
    still before midnight is stamped at the open record's start, in February, where the carry went."""
    stub, clock = _Engine(), _Clock(_at(-1_000_000))
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100", clock=clock)
    stub.gpu = ([], 1_000_100, 5, _at(-50), 0)
    _, record = await feeder.drain_gpu_time()
    assert record.ended_at == _at(100) and record.carried_us == 1_000_100
    clock.now, stub.charged = _at(-20), {"r1": (1_000_100, 0)}
    served = await feeder.serve(_item("r1", _at(-999_000)), "standard")
    assert served.outcome.usage.created_at == _at(100)


async def test_a_result_after_midnight_from_an_engine_clock_that_stands_before_it_is_carried(engine: Engine) -> None:
    """An engine process's clock is the one its last pass sent (it stands still while no step runs): a result of its
    last pass before midnight that reaches the worker after it is a February row, and the records that follow, ending at
    that clock, stay January's. The worker's next record must still carry the request's January busy time, or January
    shows it unexplained and February bills it with no busy time, for good once the worker stops."""
    ledger = Ledger(engine, CONFIG.model_copy(update={"url": str(engine.url)}))
    stub, clock = _Engine(), _Clock(_at(-1_000_000))
    feeder = EngineFeeder(stub, store=None, worker_id="w0", gpu_kind="h100", clock=clock)
    stub.charged = {"r1": (500, 0)}
    clock.now = _at(200)
    served = await feeder.serve(_item("r1", _at(-900_000)), "standard")
    assert served.outcome.usage.created_at == _at(200)
    records = []
    for engine_clock, busy_us, steps, worker_clock in ((_at(-50), 500, 2, _at(300)), (_at(-50), 0, 0, _at(1_000_000))):
        stub.gpu, clock.now = ([], busy_us, steps, engine_clock, 0), worker_clock
        records.append((await feeder.drain_gpu_time())[1])  # the last drain: the worker's stop
    ledger.record_usage([served.outcome.usage])
    ledger.record_busy([r for r in records if r is not None])
    january = reconcile_report(engine, "2027-01", CONFIG, now=LATER)
    february = reconcile_report(engine, "2027-02", CONFIG, now=LATER)
    assert (january.us("unexplained_busy"), february.us("unexplained_busy")) == (0, 0)
    assert january.us("carried_out") == february.us("carried_in") == 500
