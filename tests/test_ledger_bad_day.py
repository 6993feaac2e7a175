"""The ledger's PostgreSQL on a bad day, short of an outage: switched to read-only (as after a failover to a standby),
and migrated ahead by a newer lorabatch under a running worker. The ledger says which it is and what to do; a worker
spools while it cannot write and says the ledger is back only once it can, and no record is lost or written twice.

Each test makes a PostgreSQL database of its own on the machine's server (ALTER DATABASE reaches only it) and drops
it after; an outage of the server itself is tests/adversarial/test_ledger_outage.py.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
from aiokafka import TopicPartition
from sqlalchemy import create_engine

from billing import db
from billing.config import LedgerConfig
from billing.errors import LedgerSchemaError, LedgerUnavailableError
from billing.ledger import Ledger
from billing.records import UsageRecord
from consumer.cli.common import operational_message
from consumer.delivery import Deliverer, Outcome
from consumer.ledger_calls import LedgerCalls
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import Result
from consumer.spool import Spool
from migrations import SCRIPT_LOCATION
from tests.db_fixtures import PG_ADMIN_URL

pytestmark = pytest.mark.postgres

NOW = datetime.now(UTC)


@pytest.fixture
def own_db() -> Iterator[tuple[str, str]]:
    """(its name, its URL): a migrated ledger database of this test's own, dropped after."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"lorabatch_badday_{secrets.token_hex(4)}"
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"
    try:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        yield name, url
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


def _admin(*statements: str, url: str = PG_ADMIN_URL) -> None:
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as c:
            for s in statements:
                c.exec_driver_sql(s)
    finally:
        engine.dispose()


def _usage(i: int) -> UsageRecord:
    return UsageRecord(tenant_id="acme", request_id=f"r{i}", status="succeeded", created_at=NOW, base_us=1000 + i,
                       output_tokens=2, worker_id="w1")


def _outcome(i: int) -> Outcome:
    result = Result(request_id=f"r{i}", tenant_id="acme", status="succeeded", text="hi", finish_reason="length")
    return Outcome(TopicPartition("jobs", 0), i, result=result, usage=_usage(i), epoch=1, sent={"result"})


def _deliverer(ledger: Ledger, tmp_path, n: int) -> tuple[Deliverer, OffsetTracker, Spool]:
    offsets = OffsetTracker()
    for i in range(n):
        offsets.fetched(TopicPartition("jobs", 0), i)
    spool = Spool(tmp_path / "spool.sqlite", max_records=1000)
    d = Deliverer(None, None, ledger, offsets, WorkerMetrics(), "w1", lambda t: True, spool, flush_s=0.01)  # type: ignore[arg-type]
    return d, offsets, spool


def test_a_read_only_ledger_says_so_and_the_fix(own_db) -> None:
    """A database switched to read-only (as a failover to a standby leaves it) fails writes, and the ping that says the
    ledger is back, with a retriable LedgerUnavailableError naming read-only and the fix; it was psycopg's InternalError,
    which the worker logged as a bug of its own, and the ping (a read) passed."""
    name, url = own_db
    engine = db.make_engine(url)
    ledger = Ledger(engine, LedgerConfig(url=url))
    try:
        _admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        engine.dispose()  # reconnects, as after a failover
        for call in (lambda: ledger.record_usage([_usage(1)]), ledger.ping):
            with pytest.raises(LedgerUnavailableError, match="read-only.*point ledger.url at the writable primary") as e:
                call()
            assert e.value.retriable
        _admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')  # its connections stay open
        ledger.ping()
        assert ledger.record_usage([_usage(1)]) == 1 and ledger.count_usage() == 1
    finally:
        engine.dispose()


async def test_a_worker_spools_while_its_ledger_is_read_only(own_db, tmp_path, caplog) -> None:
    """Deliveries while the ledger is read-only spool their records, with one clear line saying read-only (no
    "failed unexpectedly" traceback), and their offsets count as done; once writable, the next flush writes each row
    once, on the connections the worker has (a session keeps the read-only it began with: its pool is dropped)."""
    name, url = own_db
    engine = db.make_engine(url)
    ledger = Ledger(engine, LedgerConfig(url=url))
    d, offsets, spool = _deliverer(ledger, tmp_path, 6)
    try:
        await d.deliver([_outcome(0), _outcome(1)])
        _admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
        engine.dispose()
        await d.deliver([_outcome(2), _outcome(3)])
        await d.deliver([_outcome(4), _outcome(5)])
        await d.flush_once()
        assert len(spool) == 4 and "read-only" in (d.ledger_down or "") and not d.schema_behind
        assert offsets.committable() == {TopicPartition("jobs", 0): 6}
        assert "failed unexpectedly" not in caplog.text and "read-only" in caplog.text
        _admin(f'ALTER DATABASE "{name}" SET default_transaction_read_only = off')  # the worker's connections stay
        await d.flush_once()
        assert len(spool) == 0 and d.ledger_down is None
        await d.flush_once()
        assert ledger.count_usage() == 6
    finally:
        spool.close()
        engine.dispose()


async def test_a_ledger_migrated_ahead_under_a_running_worker_is_written_on(own_db, tmp_path) -> None:
    """A newer lorabatch's `db upgrade` (here a nullable column, revision 9999) lands while a worker's ledger is away: its
    writes still fit the schema, so once the ledger answers the worker says it is back. The ping read the revision
    alone and said the schema was behind ("migrate it with `lorabatch db upgrade`"): with its spool drained, the worker
    held its fetching for as long as it ran."""
    _, url = own_db
    engine = db.make_engine(url)
    ledger = Ledger(engine, LedgerConfig(url=url))
    d, _, spool = _deliverer(ledger, tmp_path, 2)
    try:
        d._down(LedgerUnavailableError("the ledger database did not answer within 10 s"))
        _admin("ALTER TABLE usage ADD COLUMN region varchar(16)", "UPDATE alembic_version SET version_num = '9999'", url=url)
        await d.deliver([_outcome(0), _outcome(1)])  # the spool is empty: written straight on
        d._down(LedgerUnavailableError("the ledger database did not answer within 10 s"))
        await d.flush_once()
        assert d.ledger_down is None and not d.schema_behind
        assert ledger.count_usage() == 2
    finally:
        spool.close()
        engine.dispose()


def test_a_ledger_migrated_ahead_past_this_code_says_which_lorabatch_to_run(own_db) -> None:
    """A newer revision whose schema this code cannot write (a column it writes was dropped) is LedgerSchemaError naming
    the newer lorabatch as the fix: `lorabatch db upgrade` of this one, which it told to run, has no script to move it."""
    _, url = own_db
    _admin("ALTER TABLE usage DROP COLUMN route_reason", "UPDATE alembic_version SET version_num = '9999'", url=url)
    engine = db.make_engine(url)
    ledger = Ledger(engine, LedgerConfig(url=url))
    try:
        for call in (lambda: ledger.record_usage([_usage(1)]), ledger.ping):
            with pytest.raises(LedgerSchemaError, match="revision 9999.*newer lorabatch.*version that migrated it") as e:
                call()
            assert "db upgrade" not in str(e.value)
    finally:
        engine.dispose()


def test_db_upgrade_behind_a_long_query_gives_way_and_says_so(own_db) -> None:
    """`db upgrade` whose ALTER TABLE waits on a finance report's open transaction would queue every worker's read and
    write of that table behind it for as long as the report ran; it now takes each lock within its lock timeout, tries
    again, then fails naming the cause and fix, with nothing changed; once the report ends it migrates."""
    _, url = own_db
    db.downgrade(url, "0008", script_location=SCRIPT_LOCATION)
    engine = create_engine(url)
    report = engine.connect()
    release = threading.Timer(8.0, report.close)  # without the bound, the upgrade waits for this and then succeeds
    try:
        report.exec_driver_sql("BEGIN")
        report.exec_driver_sql("SELECT count(*) FROM usage").all()
        release.start()
        with pytest.raises(LedgerUnavailableError, match="waited 0.2 s for a lock .* 2 times, and changed nothing") as e:
            db.upgrade(url, script_location=SCRIPT_LOCATION, lock_timeout_s=0.2, tries=2)
        assert "pg_stat_activity" in (operational_message(e.value) or "")  # the CLI's one error line, whole
        assert db.current_revision(engine) == "0008"
        report.exec_driver_sql("SELECT count(*) FROM usage").all()  # the report goes on, unharmed
    finally:
        release.cancel()
        report.close()
    db.upgrade(url, script_location=SCRIPT_LOCATION, lock_timeout_s=0.2, tries=2)
    assert db.current_revision(engine) == db.SCHEMA_REVISION
    engine.dispose()


async def test_a_lock_held_on_usage_is_named_as_the_cause_and_nothing_lands_twice(own_db) -> None:
    """`LOCK TABLE usage` held while a worker writes: with the server's lock_timeout the write fails, and without one
    the worker's call times out (consumer.ledger_calls); both say a lock may be held and where to look, where they said
    only "check that it is running and reachable" (or "paused, hung, or cut off"). Once the lock goes, the write that
    waited lands, and the same records written again from the spool add nothing."""
    _, url = own_db
    bounded_url = f"{url}?options=-clock_timeout%3D200ms"
    engines = [db.make_engine(url), db.make_engine(bounded_url)]
    ledger, bounded = Ledger(engines[0], LedgerConfig(url=url)), Ledger(engines[1], LedgerConfig(url=bounded_url))
    holder = create_engine(url).connect()
    calls = LedgerCalls(timeout_s=0.3, threads=1)
    try:
        holder.exec_driver_sql("BEGIN")
        holder.exec_driver_sql("LOCK TABLE usage IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(LedgerUnavailableError, match="cancelled a statement.*lock on its tables.*pg_stat_activity"):
            bounded.record_usage([_usage(1)])
        with pytest.raises(LedgerUnavailableError, match="lock is held on its tables: see pg_stat_activity"):
            await calls(ledger.record_usage, [_usage(1)])
        with pytest.raises(LedgerUnavailableError, match="lock is held on its tables: see pg_stat_activity"):
            await calls(ledger.record_usage, [_usage(1)])
        holder.exec_driver_sql("ROLLBACK")
        while calls.hung_for() is not None:
            await asyncio.sleep(0.01)
        assert await calls(ledger.record_usage, [_usage(1), _usage(2)]) == 1  # r1 landed late, once
        assert ledger.count_usage() == 2
    finally:
        holder.close()
        calls.close()
        for e in engines:
            e.dispose()
