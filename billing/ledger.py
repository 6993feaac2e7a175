"""The ledger: one row per (tenant, request_id) with its measured GPU time and cost, written idempotently.

Workers consume Kafka at least once, so the same request can arrive twice, in one flush or in two,
from one worker or from two racing over a rebalanced partition. Every write is an
INSERT ... ON CONFLICT (tenant_id, request_id) DO NOTHING: the first row stays, later copies add nothing.
Adapter loads (key: worker, adapter, time) and GPU busy records (key: worker, start) are written the
same way, so a retried flush adds nothing either.

Each write files its rows into the invoice that bills them (billing/filing.py): a row that arrives
after its tenant's invoice of its month was closed is billed on the next open period instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import fields
from datetime import timedelta
from typing import Any

from sqlalchemy import Engine, func, inspect, select, tuple_
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, InterfaceError, OperationalError
from sqlalchemy.orm import Session

from billing.billable import FIRST_YEAR, LAST_YEAR
from billing.checks import ADAPTER, SHA256, STATUSES, RowChecker, reject
from billing.config import LedgerConfig
from billing.cost import gpu_cost
from billing.credit import kv_credit_us
from billing.db import SCHEMA_REVISION, current_revision, dialect_insert, session_factory, shown_url
from billing.errors import LedgerRecordError, LedgerSchemaError, LedgerUnavailableError
from billing.filing import file_loads, file_usage
from billing.models import AdapterLoad, Base, Busy, Usage, UsageRedelivery
from billing.periods import period_of
from billing.pg_copy import copy_insert
from billing.prices import PriceBook
from billing.records import AdapterLoadRecord, AnsweredRow, BusyRecord, UsageRecord

# Keys per statement of Ledger.answered: 1000 bound parameters, far below SQLite's limit (32766) and
# PostgreSQL's (65535), and one statement answers a whole 500-job flush.
ANSWERED_CHUNK = 500
# A usage row's own cost is numeric(18, 9): PostgreSQL refuses 10^9 or more with a DataError, which the worker took for
# the ledger being down and spooled, so the record came back at every retry and held every record behind it in the spool.
ROW_COST_LIMIT = 10**9
# SQLSTATE read_only_sql_transaction: psycopg raises it as an InternalError, which the worker took for a bug of its own
# (a traceback per write, "failed unexpectedly") on a database switched to read-only.
_READ_ONLY = "25006"
# SQLSTATEs lock_not_available (lock_timeout) and query_canceled (statement_timeout): told "check that it is running
# and reachable", an operator looked at a server that ran, when a lock on the ledger's tables was what to find.
_CANCELLED = ("55P03", "57014")
# SQLSTATE insufficient_privilege: a role that lost its grants (a permissions change, a role rotated to one without them)
# was psycopg's ProgrammingError, unmapped: a traceback and "the ledger is unavailable" with nothing on what to grant.
_NO_PRIVILEGE = "42501"
# SQLSTATE classes data exception (22: a value too long for its column, a NUL in text) and integrity constraint violation
# (23: a CHECK or NOT NULL an operator added): the database refuses the record itself, at every retry. Raised unmapped,
# the worker took it for the ledger being down and spooled it, and the flush retried it for good, holding every record
# behind it in the spool unbilled and lorabatch_ledger_up at 0 while the ledger was up.
_REFUSED = ("22", "23")

class Ledger:
    """Writes usage, busy and adapter-load records to the ledger database and reads rows back (one, or the answered keys of a batch)."""

    def __init__(self, engine: Engine, config: LedgerConfig):
        self._engine = engine
        self._config = config
        self._sessions = session_factory(engine)
        self._insert = dialect_insert(engine.dialect.name)
        # Chosen once: PostgreSQL takes usage rows through binary COPY (billing/pg_copy.py, ~8x the
        # multi-row INSERT's rate); SQLite through multi-row INSERTs, which it runs in-process.
        self._copy = engine.dialect.name == "postgresql"

    def record_usage(self, records: Sequence[UsageRecord]) -> int:
        """Write `records` in one transaction (binary COPY on PostgreSQL, multi-row INSERTs on SQLite); return how many rows are new.

        A record whose (tenant_id, request_id) is already in the ledger, or earlier in `records`, adds
        no row; if another run measured it (another worker, or another run's finish instant), it is kept as redelivered work.
        Every record is checked before anything is written, so a bad one fails the whole batch with
        LedgerRecordError and leaves the ledger untouched. Each row's `cost` is its net GPU time (less
        the KV credit as billed, billing/credit.py) at the price of its gpu_kind in effect at its created_at
        (informational: invoices price the sums; a kind with no price yet gets ledger.gpu_price_per_hour here,
        and invoices refuse it until it has one).
        """
        # Sorted by the unique key, two workers writing overlapping batches take row locks in the same
        # order, so PostgreSQL makes one wait for the other instead of failing one as a deadlock (two
        # 3000-row batches in opposite orders deadlocked in 3 runs of 3 without the sort).
        rows = [self._usage_row(r) for r in records]
        if not rows:
            return 0
        if not self._copy:  # the COPY path orders its INSERT in SQL
            rows.sort(key=lambda row: (row["tenant_id"], row["request_id"]))
        table = Usage.__table__
        statement = (
            self._insert(table)
            .on_conflict_do_nothing(index_elements=[table.c.tenant_id, table.c.request_id])
            .returning(table.c.id)  # only rows actually inserted come back
        )
        with self._database_errors(), self._sessions.begin() as session:
            filed = file_usage(session, {(row["tenant_id"], row["period"]) for row in rows})
            prices = PriceBook.load(session, self._config.gpu_kind, self._config.gpu_price_per_hour, self._config.currency, tokens=False)
            for row in rows:
                row["invoice_period"] = filed[(row["tenant_id"], row["period"])]
                credit = kv_credit_us(kv_saved_us=row["kv_saved_us"], base_us=row["base_us"], lora_us=row["lora_us"],
                                      input_tokens=row["input_tokens"], cached_tokens=row["cached_tokens"], output_tokens=row["output_tokens"])
                net_us = row["base_us"] + row["lora_us"] + row["routing_us"] - credit
                price = prices.gpu_price_or_fallback(row["created_at"], row["gpu_kind"])
                row["cost"] = gpu_cost(net_us, price)
                if row["cost"] >= ROW_COST_LIMIT:
                    reject(f"usage record tenant_id={row['tenant_id']!r} request_id={row['request_id']!r}", "base_us", row["base_us"],
                           f"its {net_us} us at {price} per GPU hour cost {row['cost']}, and the ledger keeps a request's cost "
                           f"below {ROW_COST_LIMIT} (numeric(18, 9)); check the record's times and the GPU price")
            if self._copy:
                inserted = copy_insert(session, table, rows, key=("tenant_id", "request_id"))
            else:
                inserted = len(session.execute(statement, rows).all())
            if inserted < len(rows):
                self._keep_redeliveries(session, rows)
            return inserted

    def _keep_redeliveries(self, session: Session, rows: list[dict[str, Any]]) -> None:
        """Keep the copies in `rows` that a second run measured (billing.models.UsageRedelivery).

        Read only when some row was not new. A copy whose worker and finish instant (created_at) are those of the
        stored row is the same run written again (a retried flush, the spool): nothing to keep.
        """
        keys = sorted({(row["tenant_id"], row["request_id"]) for row in rows})
        stored: dict[tuple[str, str], tuple[str, Any]] = {}
        for start in range(0, len(keys), ANSWERED_CHUNK):
            chunk = keys[start:start + ANSWERED_CHUNK]
            statement = select(Usage.tenant_id, Usage.request_id, Usage.worker_id, Usage.created_at).where(
                tuple_(Usage.tenant_id, Usage.request_id).in_(chunk))
            for tenant_id, request_id, worker_id, created_at in session.execute(statement):
                stored[(tenant_id, request_id)] = (worker_id, created_at)
        copies = {}
        for row in rows:
            first = stored[(row["tenant_id"], row["request_id"])]
            if first != (row["worker_id"], row["created_at"]):
                copy = {name: row[name] for name in _REDELIVERY_COLUMNS}
                copies[(copy["tenant_id"], copy["request_id"], copy["worker_id"], copy["created_at"])] = copy
        if copies:
            table = UsageRedelivery.__table__
            session.execute(
                self._insert(table).on_conflict_do_nothing(
                    index_elements=[table.c.tenant_id, table.c.request_id, table.c.worker_id, table.c.created_at]),
                [copies[key] for key in sorted(copies)],
            )

    def record_adapter_loads(self, records: Sequence[AdapterLoadRecord]) -> int:
        """Write one row per adapter load; return how many are new (a load written twice counts once)."""
        rows = [self._load_row(r) for r in records]
        if not rows:
            return 0
        table = AdapterLoad.__table__
        statement = (
            self._insert(table)
            .on_conflict_do_nothing(index_elements=[table.c.worker_id, table.c.adapter, table.c.created_at])
            .returning(table.c.id)
        )
        with self._database_errors(), self._sessions.begin() as session:
            filed = file_loads(session, {row["period"] for row in rows})
            for row in rows:
                row["invoice_period"] = filed[row["period"]]
            return len(session.execute(statement, rows).all())

    def record_busy(self, records: Sequence[BusyRecord]) -> int:
        """Write GPU busy records; return how many are new (key: worker_id, started_at)."""
        rows = sorted((self._busy_row(r) for r in records), key=lambda row: (row["worker_id"], row["started_at"]))
        if not rows:
            return 0
        table = Busy.__table__
        statement = (
            self._insert(table)
            .on_conflict_do_nothing(index_elements=[table.c.worker_id, table.c.started_at])
            .returning(table.c.id)
        )
        with self._database_errors(), self._sessions.begin() as session:
            return len(session.execute(statement, rows).all())

    def ping(self) -> None:
        """Keep no row; raise what a write would (LedgerUnavailableError, LedgerSchemaError) if the ledger cannot take
        one now. A worker asks it before it says the ledger is back without a write to prove it (its spool empty).

        It writes, as a write does: an INSERT of no rows into every ledger table, rolled back. Reading the schema's
        revision said a read-only database (a failover to a standby, default_transaction_read_only) took writes, and
        one migrated ahead by a newer lorabatch (whose writes this code still made) did not: a worker drained of its
        spool held its fetching for good, saying "migrate it with `lorabatch db upgrade`", which had nothing to do."""
        with self._database_errors(), self._engine.connect() as connection:
            for table in Base.metadata.sorted_tables:
                columns = ", ".join(f'"{c.name}"' for c in table.columns)
                connection.exec_driver_sql(f'INSERT INTO "{table.name}" ({columns}) SELECT {columns} FROM "{table.name}" WHERE 1 = 0')
            connection.rollback()

    def usage_for(self, tenant_id: str, request_id: str) -> Usage | None:
        """The ledger row of one request, or None when it was never recorded."""
        statement = select(Usage).where(Usage.tenant_id == tenant_id, Usage.request_id == request_id)
        with self._database_errors(), self._sessions() as session:
            return session.scalars(statement).one_or_none()

    def answered(self, keys: Iterable[tuple[str, str]]) -> dict[tuple[str, str], AnsweredRow]:
        """For each (tenant_id, request_id) of `keys` that already has its usage row, what that row holds.

        Keys without a row are absent from the answer. One read transaction, one statement per
        ANSWERED_CHUNK distinct keys.
        """
        wanted = sorted(set(keys))
        columns = [Usage.__table__.c[f.name] for f in fields(AnsweredRow)]
        found: dict[tuple[str, str], AnsweredRow] = {}
        if not wanted:
            return found
        with self._database_errors(), self._sessions() as session:
            for start in range(0, len(wanted), ANSWERED_CHUNK):
                chunk = wanted[start:start + ANSWERED_CHUNK]
                statement = select(Usage.tenant_id, Usage.request_id, *columns).where(tuple_(Usage.tenant_id, Usage.request_id).in_(chunk))
                for tenant_id, request_id, *values in session.execute(statement):
                    found[(tenant_id, request_id)] = AnsweredRow(*values)
        return found

    def count_usage(self, tenant_id: str | None = None) -> int:
        """Number of usage rows, of one tenant or of all."""
        statement = select(func.count()).select_from(Usage)
        if tenant_id is not None:
            statement = statement.where(Usage.tenant_id == tenant_id)
        with self._database_errors(), self._sessions() as session:
            return session.scalar(statement) or 0

    def count_adapter_loads(self, adapter: str | None = None) -> int:
        """Number of adapter-load rows, of one adapter (name@version) or of all."""
        statement = select(func.count()).select_from(AdapterLoad)
        if adapter is not None:
            statement = statement.where(AdapterLoad.adapter == adapter)
        with self._database_errors(), self._sessions() as session:
            return session.scalar(statement) or 0

    def _usage_row(self, record: UsageRecord) -> dict[str, Any]:
        row = dict(record.__dict__)

        def what() -> str:
            return f"usage record tenant_id={record.tenant_id!r} request_id={record.request_id!r}"

        _USAGE_CHECK.check(row, what)
        if record.status not in STATUSES:
            reject(what(), "status", record.status, f"use one of {', '.join(STATUSES)}")
        if record.adapter is not None and not ADAPTER.fullmatch(record.adapter):
            reject(what(), "adapter", record.adapter, "write the resolved adapter as name@version, or None for the base model")
        if record.adapter_sha256 is not None and not SHA256.fullmatch(record.adapter_sha256):
            reject(what(), "adapter_sha256", record.adapter_sha256, "pass the 64 lowercase hex digits of the adapter's sha256, or None")
        _check_kind(row, what)
        tier = record.tier
        if tier is not None and (not tier.strip() or tier != tier.strip()):
            reject(what(), "tier", tier, "pass the tenant's registry tier (1 to 32 characters without surrounding spaces), or None")
        row["period"] = _billable_period(row, "created_at", what)
        return row

    def _load_row(self, record: AdapterLoadRecord) -> dict[str, Any]:
        row = dict(record.__dict__)

        def what() -> str:
            return f"adapter load record adapter={record.adapter!r} worker_id={record.worker_id!r}"

        _LOAD_CHECK.check(row, what)
        if not ADAPTER.fullmatch(record.adapter):
            reject(what(), "adapter", record.adapter, "write the adapter as name@version")
        if not SHA256.fullmatch(record.adapter_sha256):
            reject(what(), "adapter_sha256", record.adapter_sha256, "pass the 64 lowercase hex digits of the adapter's sha256")
        _check_kind(row, what)
        row["period"] = _billable_period(row, "created_at", what)
        return row

    def _busy_row(self, record: BusyRecord) -> dict[str, Any]:
        row = dict(record.__dict__)

        def what() -> str:
            return f"busy record worker_id={record.worker_id!r} started_at={record.started_at!r}"

        _BUSY_CHECK.check(row, what)
        for key in ("worker_id", "gpu_kind"):
            if not row[key]:
                reject(what(), key, row[key], "pass a non-empty name")
        span_us = (record.ended_at - record.started_at) // timedelta(microseconds=1)
        if span_us < 0:
            reject(what(), "ended_at", record.ended_at, "pass an ended_at at or after started_at")
        # Step times are rounded to whole microseconds one by one, so their sum may pass the wall span
        # by up to one microsecond per step; more than that is a clock or accounting error.
        if record.busy_us > span_us + record.steps:
            reject(what(), "busy_us", record.busy_us, f"the GPU cannot be busy longer than the record's wall span of {span_us} us; "
                   "stamp started_at before the first step and ended_at after the last")
        row["period"] = _billable_period(row, "started_at", what)
        row["carried_to"] = None
        if record.carried_us:
            row["carried_to"] = _billable_period(row, "ended_at", what)
            if row["carried_to"] == row["period"]:
                reject(what(), "carried_us", record.carried_us, "carry busy time only on a record whose ended_at is in a "
                       "later month than its started_at (the month's last record)")
        return row

    @contextmanager
    def _database_errors(self) -> Iterator[None]:
        """Database failures as the ledger's typed errors, each saying what to do about it.

        A schema that is missing, behind, or lost tables (dropped outside Alembic) is LedgerSchemaError,
        whatever the failing statement raised: retrying cannot help. Otherwise a database that did not
        answer (refused, closed or lost connection, locked file) is the retriable LedgerUnavailableError.
        """
        url = shown_url(self._engine.url)
        try:
            yield
        except DBAPIError as exc:
            try:
                schema = _schema_fault(self._engine)
            except DBAPIError:
                schema = None  # the database cannot be reached to look: the failure is the connection
            if schema is not None:
                raise LedgerSchemaError(f"the ledger database at {url} {schema}") from exc
            if getattr(exc.orig, "sqlstate", None) == _READ_ONLY:
                # A session keeps the read-only it started with: pooled connections stayed read-only after the database
                # was made writable again (a drill's worker had 14 records spooled 40 s after, until it was restarted).
                # So they are dropped; the next call connects anew, to whatever the URL names now.
                self._engine.dispose()
                raise LedgerUnavailableError(
                    f"the ledger database at {url} is read-only ({str(exc.orig).splitlines()[0]}): it is a standby (a failover moved the "
                    f"primary elsewhere) or has default_transaction_read_only on; point ledger.url at the writable "
                    f"primary, or make this one writable again (ALTER DATABASE ... SET default_transaction_read_only = "
                    f"off), then retry (ledger writes are idempotent, a retry adds no duplicate row)"
                ) from exc
            if isinstance(exc, (DataError, IntegrityError)) or str(getattr(exc.orig, "sqlstate", None))[:2] in _REFUSED:
                raise LedgerRecordError(
                    f"the ledger database at {url} refused the record ({type(exc.orig).__name__}: "
                    f"{str(exc.orig).splitlines()[0]}): a value does not fit its column or a constraint of the table "
                    f"refuses it; fix the record's writer, or the constraint if it was added by hand"
                ) from exc
            if getattr(exc.orig, "sqlstate", None) == _NO_PRIVILEGE:
                role = self._engine.url.username or "the role ledger.url connects as"
                raise LedgerUnavailableError(
                    f"the ledger database at {url} refused {role} ({str(exc.orig).splitlines()[0]}): the role lacks a "
                    f"privilege on the ledger's tables; run, as their owner, GRANT SELECT, INSERT, UPDATE, DELETE ON ALL "
                    f"TABLES IN SCHEMA <the ledger's schema> TO {role} (and GRANT USAGE ON ALL SEQUENCES IN SCHEMA ... "
                    f"TO {role}), then retry (ledger writes are idempotent, a retry adds no duplicate row)"
                ) from exc
            if not (isinstance(exc, (OperationalError, InterfaceError)) or exc.connection_invalidated):
                raise
            if getattr(exc.orig, "sqlstate", None) in _CANCELLED:
                raise LedgerUnavailableError(
                    f"the ledger database at {url} cancelled a statement ({str(exc.orig).splitlines()[0]}): a lock on "
                    f"its tables is held (a migration, LOCK TABLE, a long transaction: see pg_locks and "
                    f"pg_stat_activity), or its statement_timeout is shorter than a write takes; retry once it is "
                    f"released (ledger writes are idempotent, a retry adds no duplicate row)"
                ) from exc
            raise LedgerUnavailableError(
                f"the ledger database at {url} failed: {exc.orig}; check that it is running and reachable, "
                f"then retry (ledger writes are idempotent, a retry adds no duplicate row)"
            ) from exc


def _check_kind(row: dict[str, Any], what: Callable[[], str]) -> None:
    """A row's gpu_kind names a price list (billing/prices.py) or is None (not known: priced as ledger.gpu_kind)."""
    kind = row["gpu_kind"]
    if kind is not None and (not kind.strip() or kind != kind.strip()):
        reject(what(), "gpu_kind", kind, "pass the worker's ledger.gpu_kind (1 to 64 characters without surrounding spaces), or None")


def _billable_period(row: dict[str, Any], name: str, what: Callable[[], str]) -> str:
    """The period of the instant row[name], which must fall in a month invoices can bill (billing/billable.py).

    The ledger took any aware instant: a row of 0001-01 or 9999-12 (a clock or a parser gone wrong) was written, and the
    request answered from it when resubmitted, but no invoice, close or report of its month could be made, so it was billed
    to nobody; 0001-01-01 at +05:00 ended the write in an OverflowError instead of naming the field.
    """
    try:
        period = period_of(row[name])
    except OverflowError:  # the instant's UTC form is before year 1 or after 9999
        period = None
    if period is None or not FIRST_YEAR <= int(period[:4]) <= LAST_YEAR:
        reject(what(), name, row[name], f"pass an instant from {FIRST_YEAR}-01 to {LAST_YEAR}-12 UTC, the months invoices bill; "
               "check the clock of the worker that wrote it")
    return period


def _schema_fault(engine: Engine) -> str | None:
    """What is wrong with the ledger schema at `engine`, completing "the ledger database at URL ..."; None when nothing is."""
    at, want = current_revision(engine), SCHEMA_REVISION
    if at is not None and at != want and (not (at.isdigit() and want.isdigit()) or int(at) > int(want)):
        # Revisions are numbered 0001, 0002, ... (migrations/versions): a higher one is a newer lorabatch's, which
        # `lorabatch db upgrade` of this one cannot move (it has no script of it); only running that version can.
        return (f"is at schema revision {at}, which is not this code's {want} (a newer lorabatch migrated it?); run "
                f"workers and commands of the lorabatch version that migrated it")
    if at != want:
        return (f"is at schema revision {at} but this code needs {want}; "
                f"migrate it with `lorabatch db upgrade` or `alembic -x url=URL upgrade head` from the repository root")
    missing = sorted(Base.metadata.tables.keys() - set(inspect(engine).get_table_names()))
    if missing:
        return (f"is at schema revision {at} but has lost table(s) {', '.join(missing)} (dropped outside Alembic); "
                f"restore them from a backup, or drop the remaining ledger tables and alembic_version and migrate afresh "
                f"with `lorabatch db upgrade`")
    return None


_REDELIVERY_COLUMNS = ("tenant_id", "request_id", "worker_id", "created_at", "period", "adapter", "base_us", "lora_us", "routing_us")
_USAGE_CHECK = RowChecker(Usage.__table__, (f.name for f in fields(UsageRecord)))
_LOAD_CHECK = RowChecker(AdapterLoad.__table__, (f.name for f in fields(AdapterLoadRecord)))
_BUSY_CHECK = RowChecker(Busy.__table__, (f.name for f in fields(BusyRecord)))
