"""Requests the ledger has already answered, and the ledger's typed errors when its database is gone.

`Ledger.answered` is what lets a resubmitted request be answered from its stored row instead of run
and billed again. The error tests break a ledger that was working (pooled connections, PostgreSQL's
COPY staging table in place) the two ways production breaks it: the schema dropped under it, and the
database going down. Runs on SQLite and the machine's PostgreSQL (fixtures from tests/db_fixtures.py).
"""

from __future__ import annotations

import dataclasses
import socket
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from decimal import Decimal

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.engine import URL, make_url

import billing.ledger
from billing import db
from billing.config import LedgerConfig
from billing.errors import LedgerSchemaError, LedgerUnavailableError
from billing.ledger import Ledger
from billing.models import Base
from billing.records import AdapterLoadRecord, AnsweredRow, BusyRecord, UsageRecord

from migrations import SCRIPT_LOCATION
from tests.db_fixtures import fresh_pg_schema

JAN = datetime(2026, 1, 15, 12, 0, tzinfo=timezone.utc)
SHA = "ab" * 32


def usage(tenant_id: str, request_id: str, **fields: object) -> UsageRecord:
    values: dict[str, object] = {"tenant_id": tenant_id, "request_id": request_id, "status": "succeeded", "created_at": JAN}
    return UsageRecord(**(values | fields))  # type: ignore[arg-type]


def busy(second: int = 0) -> BusyRecord:
    start = JAN.replace(second=second)
    return BusyRecord(worker_id="w0", gpu_kind="h100-80g", started_at=start, ended_at=start, busy_us=0, steps=0)


def load(second: int = 0) -> AdapterLoadRecord:
    return AdapterLoadRecord(adapter="summarize@1", adapter_sha256=SHA, tenant_id="acme", tier="disk", nbytes=1,
                             load_us=10, worker_id="w0", created_at=JAN.replace(second=second))


def make_ledger(url: str | URL) -> Ledger:
    return Ledger(db.make_engine(url), LedgerConfig(url=str(url), gpu_price_per_hour=Decimal("2.50")))


@pytest.fixture
def ledger(engine: Engine) -> Ledger:
    return Ledger(engine, LedgerConfig(url=str(engine.url), gpu_price_per_hour=Decimal("2.50")))


# ---- answered ----------------------------------------------------------------------------------------


def test_answered_returns_the_stored_rows(ledger: Ledger) -> None:
    """Each recorded key comes back with its stored result body and measurements; unrecorded keys are absent."""
    body = '{"request_id": "r1", "status": "succeeded", "text": "h\\u00e9llo \\ud83d\\ude00"}'
    first = usage("acme", "r1", result_json=body, adapter="summarize@1", batch_id="b7", input_tokens=11, output_tokens=22,
                  cached_tokens=3, base_us=2**40, lora_us=5, routing_us=6, kv_saved_us=7, worker_id="gpu-3")
    failed = usage("acme", "r2", status="failed", error_code="oom", result_json='{"status": "failed"}')
    ledger.record_usage([first, failed, usage("acme", "r3")])  # r3: a body that was never stored

    answered = ledger.answered([("acme", "r1"), ("acme", "r2"), ("acme", "r3"), ("acme", "never"), ("globex", "r1")])

    assert set(answered) == {("acme", "r1"), ("acme", "r2"), ("acme", "r3")}
    for key, record in ((("acme", "r1"), first), (("acme", "r2"), failed)):
        for field in dataclasses.fields(AnsweredRow):
            assert getattr(answered[key], field.name) == getattr(record, field.name), (key, field.name)
    assert answered[("acme", "r3")].result_json is None


def test_answered_is_scoped_by_tenant(ledger: Ledger) -> None:
    """Two tenants' requests with one request_id are two answers, each with its own body."""
    ledger.record_usage([usage("acme", "r1", result_json='"acme"'), usage("globex", "r1", result_json='"globex"')])
    answered = ledger.answered([("acme", "r1"), ("globex", "r1"), ("initech", "r1")])
    assert {key: row.result_json for key, row in answered.items()} == {("acme", "r1"): '"acme"', ("globex", "r1"): '"globex"'}


def test_answered_keeps_the_first_body(ledger: Ledger) -> None:
    """A redelivered request's second result does not replace the body of the row that billed it."""
    ledger.record_usage([usage("acme", "r1", result_json='"first"')])
    ledger.record_usage([usage("acme", "r1", result_json='"second"')])
    assert ledger.answered([("acme", "r1")])[("acme", "r1")].result_json == '"first"'


def test_answered_chunks_large_key_lists(ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys past one statement's chunk, with duplicates, all come back once; the empty list asks nothing."""
    monkeypatch.setattr(billing.ledger, "ANSWERED_CHUNK", 7)
    ledger.record_usage([usage(f"t{i % 3}", f"r{i}", result_json=str(i)) for i in range(50)])
    keys = [(f"t{i % 3}", f"r{i}") for i in range(60)] * 2  # 10 unknown, every key twice
    answered = ledger.answered(iter(keys))
    assert {key: row.result_json for key, row in answered.items()} == {(f"t{i % 3}", f"r{i}"): str(i) for i in range(50)}
    assert ledger.answered([]) == {}


def test_answered_default_chunk_fits_one_statement(ledger: Ledger) -> None:
    """A batch of several default chunks (1200 keys) is answered on both backends within their bound-parameter limits."""
    ledger.record_usage([usage("acme", f"r{i:04d}", result_json="{}") for i in range(1200)])
    assert len(ledger.answered(("acme", f"r{i:04d}") for i in range(1300))) == 1200


# ---- the schema dropped under a working ledger ---------------------------------------------------------

Operation = Callable[[Ledger], object]
OPERATIONS: dict[str, Operation] = {
    "record_usage": lambda ledger: ledger.record_usage([usage("acme", "again")]),
    "record_busy": lambda ledger: ledger.record_busy([busy(1)]),
    "record_adapter_loads": lambda ledger: ledger.record_adapter_loads([load(1)]),
    "answered": lambda ledger: ledger.answered([("acme", "warm")]),
}


def _warm(ledger: Ledger) -> None:
    """Use every write path once, so the failures below meet pooled connections and PostgreSQL's staging table."""
    assert ledger.record_usage([usage("acme", "warm")]) == 1
    assert ledger.record_busy([busy()]) == 1
    assert ledger.record_adapter_loads([load()]) == 1
    assert ledger.answered([("acme", "warm")])


def _drop(url: str, what: str) -> None:
    """Drop the ledger under a running ledger: the whole schema, or its tables but not Alembic's version row."""
    engine = db.make_engine(url)
    try:
        with engine.begin() as connection:
            if what == "schema" and engine.dialect.name == "postgresql":
                schema = connection.exec_driver_sql("SELECT current_schema()").scalar_one()
                connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE; CREATE SCHEMA "{schema}"')
                return
            tables = list(Base.metadata.tables) + (["alembic_version"] if what == "schema" else [])
            for table in tables:
                connection.exec_driver_sql(f'DROP TABLE "{table}"' + (" CASCADE" if engine.dialect.name == "postgresql" else ""))
    finally:
        engine.dispose()


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize(("what", "says"), [("schema", r"revision None but this code needs .*upgrade"),
                                            ("tables", r"lost table\(s\) .*usage.*migrate afresh")])
def test_dropped_schema_is_a_schema_error(migrated_url: str, operation: str, what: str, says: str) -> None:
    """A ledger whose schema (or every table of it) was dropped while it ran fails with a non-retriable LedgerSchemaError saying how to fix it."""
    ledger = make_ledger(migrated_url)
    try:
        _warm(ledger)
        _drop(migrated_url, what)
        with pytest.raises(LedgerSchemaError, match=says) as raised:
            OPERATIONS[operation](ledger)
        assert raised.value.retriable is False
    finally:
        ledger._engine.dispose()


# ---- the database going down ---------------------------------------------------------------------------


class _Relay:
    """A TCP relay to PostgreSQL that can be cut: cut() closes the listener and every relayed connection, as a server that goes down does."""

    def __init__(self, target: tuple[str, int]):
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # cut, or the other side closed

    def cut(self) -> None:
        if self._listener.fileno() == -1:
            return  # cut already
        self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() above
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by its peer
                sock.close()


@contextmanager
def _ledger_that_goes_down(backend: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Ledger, Callable[[], None]]]:
    """A warm ledger and the function that takes its database down."""
    if backend == "sqlite":
        url = f"sqlite:///{request.getfixturevalue('tmp_path') / 'ledger.db'}"
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_S", 0.05)  # 50 ms of waiting for the lock, not 30 s
        ledger = make_ledger(url)
        holder: list[sqlite3.Connection] = []

        def down() -> None:
            # Another process holding the file exclusively: no connection can read or write it.
            ledger._engine.dispose()  # idle connections would keep the lock from being taken
            holder.append(sqlite3.connect(make_url(url).database, isolation_level=None))
            holder[0].execute("PRAGMA locking_mode=EXCLUSIVE")
            holder[0].execute("BEGIN EXCLUSIVE")

        try:
            yield ledger, down
        finally:
            for connection in holder:
                connection.close()
            ledger._engine.dispose()
        return
    with fresh_pg_schema(request.getfixturevalue("pg_database")) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        target = make_url(url)
        relay = _Relay((target.host or "127.0.0.1", target.port or 5432))
        ledger = make_ledger(target.set(port=relay.port).update_query_dict({"connect_timeout": "2"}))
        try:
            yield ledger, relay.cut
        finally:
            ledger._engine.dispose()
            relay.cut()


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("backend", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def test_database_down_is_retriable(backend: str, operation: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A working ledger whose database goes down fails with the retriable LedgerUnavailableError, never a schema or record error."""
    with _ledger_that_goes_down(backend, request, monkeypatch) as (ledger, down):
        _warm(ledger)
        down()
        with pytest.raises(LedgerUnavailableError, match="retry") as raised:
            OPERATIONS[operation](ledger)
        assert raised.value.retriable is True


def test_answered_reads_rows_written_before_result_bodies(db_url: str) -> None:
    """A row written at revision 0003 (before result_json) is answered after the upgrade, with no body."""
    db.upgrade(db_url, "0003", script_location=SCRIPT_LOCATION)
    engine = db.make_engine(db_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO usage (tenant_id, request_id, status, route_reason, input_tokens, output_tokens, cached_tokens, base_us, lora_us, "
                "routing_us, kv_saved_us, queue_us, ttft_us, total_us, cost, period, invoice_period, created_at, worker_id) VALUES "
                "('acme', 'old', 'succeeded', '', 1, 2, 0, 5, 0, 0, 0, 0, 0, 5, 0, '2026-01', '2026-01', '2026-01-02 10:00:00+00', 'w0')"))
        db.upgrade(db_url, script_location=SCRIPT_LOCATION)
        row = Ledger(engine, LedgerConfig(url=db_url)).answered([("acme", "old")])[("acme", "old")]
        assert (row.result_json, row.status, row.input_tokens, row.output_tokens, row.base_us) == (None, "succeeded", 1, 2, 5)
    finally:
        engine.dispose()
