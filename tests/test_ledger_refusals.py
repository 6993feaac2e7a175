"""Records the ledger database itself refuses (a CHECK an operator added, a value its column cannot hold, a NUL in text)
are the record's fault, not the ledger's: they go to the DLQ with the database's reason, and every record around them
is written, from a delivery or from the spool. They were raised unmapped, taken for the ledger being down, and spooled;
the flush then retried them for good, holding every record behind them unbilled with lorabatch_ledger_up at 0.

Each test makes a PostgreSQL database of its own on the machine's server and drops it after.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from aiokafka import TopicPartition
from sqlalchemy import create_engine

from billing import db
from billing.config import LedgerConfig
from billing.errors import LedgerRecordError
from billing.ledger import Ledger
from billing.records import UsageRecord
from consumer.config import KafkaConfig
from consumer.delivery import Deliverer, Outcome
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import Result
from consumer.spool import Spool
from migrations import SCRIPT_LOCATION
from tests.db_fixtures import PG_ADMIN_URL

pytestmark = pytest.mark.postgres

NOW = datetime.now(UTC)


@pytest.fixture
def own_db() -> Iterator[str]:
    """The URL of a migrated ledger database of this test's own, dropped after."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"lorabatch_refusals_{secrets.token_hex(4)}"
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        yield url
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _sql(url: str, *statements: str) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            for s in statements:
                c.exec_driver_sql(s)
    finally:
        engine.dispose()


class Producer:
    """Takes every message at once and keeps what went to each topic."""

    def __init__(self):
        self.sent: dict[str, list[bytes]] = {}

    async def send(self, topic, value, key=None):
        self.sent.setdefault(topic, []).append(value)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done


def _usage(i: int, route_reason: str = "") -> UsageRecord:
    return UsageRecord(tenant_id="acme", request_id=f"r{i}", status="succeeded", created_at=NOW, base_us=1000 + i,
                       output_tokens=2, worker_id="w1", route_reason=route_reason)


def _outcome(i: int, route_reason: str = "") -> Outcome:
    result = Result(request_id=f"r{i}", tenant_id="acme", status="succeeded", text="hi", finish_reason="length")
    return Outcome(TopicPartition("jobs", 0), i, result=result, usage=_usage(i, route_reason), epoch=1, sent={"result"})


def _rig(ledger, tmp_path, n: int) -> tuple[Deliverer, OffsetTracker, Spool, Producer]:
    offsets = OffsetTracker()
    for i in range(n):
        offsets.fetched(TopicPartition("jobs", 0), i)
    spool = Spool(tmp_path / "spool.sqlite", max_records=1000)
    producer = Producer()
    d = Deliverer(KafkaConfig(), producer, ledger, offsets, WorkerMetrics(), "w1", lambda t: True, spool, flush_s=0.01)  # type: ignore[arg-type]
    return d, offsets, spool, producer


def _dead(producer: Producer) -> list[tuple[str, str, str]]:
    return [(r["error"]["code"], r["request_id"], r["error"]["message"]) for r in map(json.loads, producer.sent.get(KafkaConfig().dlq_topic, []))]


@pytest.mark.parametrize("value", ["a\x00b", "x" * 100])
def test_a_value_the_database_refuses_is_a_record_error(own_db, value) -> None:
    """A NUL in text (PostgreSQL's text cannot hold one) and a value over a column an operator narrowed are refused by
    the database: LedgerRecordError (not retriable) naming the database's reason, where they were a raw DataError."""
    _sql(own_db, "ALTER TABLE usage ALTER COLUMN route_reason TYPE varchar(16)")
    engine = db.make_engine(own_db)
    ledger = Ledger(engine, LedgerConfig(url=own_db))
    try:
        with pytest.raises(LedgerRecordError, match="refused the record .*(0x00|too long).*fix the record") as e:
            ledger.record_usage([_usage(1, value)])
        assert not e.value.retriable
        assert ledger.record_usage([_usage(2, "fine")]) == 1
    finally:
        engine.dispose()


async def test_a_row_a_constraint_refuses_does_not_hold_the_others(own_db, tmp_path) -> None:
    """A CHECK added by hand refuses r2 of a delivered batch: r2 goes to the DLQ naming the constraint, the other four
    are written, nothing is spooled, and the ledger is not said down."""
    _sql(own_db, "ALTER TABLE usage ADD CONSTRAINT no_r2 CHECK (request_id <> 'r2')")
    engine = db.make_engine(own_db)
    ledger = Ledger(engine, LedgerConfig(url=own_db))
    d, offsets, spool, producer = _rig(ledger, tmp_path, 5)
    try:
        await d.deliver([_outcome(i) for i in range(5)])
        assert ledger.count_usage() == 4 and len(spool) == 0 and d.ledger_down is None
        assert [(c, r) for c, r, _ in _dead(producer)] == [("ledger_rejected", "r2")]
        assert "no_r2" in _dead(producer)[0][2]
        assert offsets.committable() == {TopicPartition("jobs", 0): 5}
    finally:
        spool.close()
        engine.dispose()


async def test_a_spooled_row_the_ledger_refuses_on_its_return_does_not_hold_the_spool(own_db, tmp_path) -> None:
    """Rows spooled while the ledger is unreachable (a port nothing listens on), one of which it refuses once it is
    back (a NUL in text): the flush writes the others once each, dead-letters that one, and empties the spool; a
    second flush adds nothing. The refused row stayed at the spool's head and every flush failed on it for good."""
    engine, down = db.make_engine(own_db), db.make_engine("postgresql+psycopg://postgres@127.0.0.1:1/nowhere")
    ledger, away = Ledger(engine, LedgerConfig(url=own_db)), Ledger(down, LedgerConfig(url=own_db))
    d, offsets, spool, producer = _rig(away, tmp_path, 6)
    try:
        await d.deliver([_outcome(0), _outcome(1, "bad\x00reason"), _outcome(2)])
        await d.deliver([_outcome(3), _outcome(4), _outcome(5)])
        assert len(spool) == 6 and d.ledger_down is not None
        assert offsets.committable() == {TopicPartition("jobs", 0): 6}
        d.ledger = ledger  # the database answers again
        await d.flush_once()
        assert len(spool) == 0 and d.ledger_down is None
        await d.flush_once()
        assert ledger.count_usage() == 5
        assert [(c, r) for c, r, _ in _dead(producer)] == [("ledger_rejected", "r1")]
    finally:
        spool.close()
        engine.dispose()
        down.dispose()
