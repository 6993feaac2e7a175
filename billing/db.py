"""Engines, sessions and schema migrations for the ledger database.

Two backends, chosen by the URL and nothing else: SQLite (the embedded default, a file) and PostgreSQL
through psycopg 3 (production). Alembic owns the schema; `upgrade` and `downgrade` run it in-process
from the scripts at `script_location`, which the process edge passes (`migrations.SCRIPT_LOCATION`, the
packaged scripts: an installed wheel needs no alembic.ini); billing never imports `migrations`.
Alembic is imported only by those functions: processes that only read and write the ledger never load it.
Likewise the ORM (`sqlalchemy.orm`, about 0.2 s of a command's start here) loads only with `session_factory`:
a command that reads through SQLAlchemy Core (`lorabatch tenants list`) never loads it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import Engine, create_engine, event, inspect, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.pool import StaticPool

from billing.config import url_without_password
from billing.errors import LedgerConfigError, LedgerUnavailableError

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.orm import Session, sessionmaker

# Seconds a SQLite writer waits for another process's write lock before failing: workers of one host
# share the file, and a ledger flush holds the lock for milliseconds.
SQLITE_BUSY_TIMEOUT_S = 30

# Seconds libpq waits for a PostgreSQL server to take a connection (its `connect_timeout`; a URL that sets one keeps it).
# A server that is paused or cut off from this host takes the TCP connection and then answers nothing: without this, a
# command (`lorabatch invoice`, `db upgrade`) waited on it for ever, and so did a worker's wait for its ledger.
PG_CONNECT_TIMEOUT_S = 10

# A migration's ALTER TABLE waits for every lock on its table, and while it waits every other statement on that table
# queues behind it: with a finance report's transaction open on usage, `db upgrade` stalled every worker's reads and
# writes of usage for as long as the report ran (6 s of a 6 s report in a drill; a minute-long one spools the fleet).
# So a migration takes each lock within MIGRATION_LOCK_TIMEOUT_S (PostgreSQL's lock_timeout, after the migration lock of
# migrations/env.py), and one that cannot is rolled back whole and tried again, MIGRATION_LOCK_TRIES times in all,
# MIGRATION_LOCK_PAUSE_S apart (the queue behind it drains meanwhile); then it fails, saying what holds it.
MIGRATION_LOCK_TIMEOUT_S = 5.0
MIGRATION_LOCK_TRIES = 6
MIGRATION_LOCK_PAUSE_S = 2.0
_LOCK_NOT_AVAILABLE = "55P03"  # SQLSTATE lock_not_available: lock_timeout fired

# Alembic's default version table, which migrations/env.py keeps: one row, the revision the schema is at.
_VERSION_TABLE = "alembic_version"

# The schema revision billing.models describes: the head of migrations/versions. A worker or command refuses a ledger at
# any other revision (`current_revision` reads it); a new migration moves this with it (tests/test_migrations.py checks
# the two agree). Here rather than in billing.models so that reading it loads no ORM.
SCHEMA_REVISION = "0012"


def _resolve_url(url: str | URL) -> URL:
    """The URL with its driver made explicit; anything but SQLite and PostgreSQL/psycopg 3 is refused."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise LedgerConfigError(
            f"ledger url {url!r} is not a database URL ({exc}); write sqlite:///PATH/ledger.db or postgresql+psycopg://USER@HOST:PORT/DB"
        ) from exc
    backend, _, driver = parsed.drivername.partition("+")
    if backend == "sqlite" and driver in ("", "pysqlite"):
        return parsed
    if backend == "postgresql" and driver in ("", "psycopg"):
        # A bare postgresql:// would make SQLAlchemy pick psycopg2, which lorabatch does not install.
        return parsed.set(drivername="postgresql+psycopg")
    raise LedgerConfigError(
        f"ledger url {shown_url(parsed)!r} uses driver {parsed.drivername!r}; "
        f"the ledger runs on sqlite:///PATH/ledger.db or postgresql+psycopg://USER@HOST:PORT/DB, change the url to one of those"
    )


def shown_url(url: URL) -> str:
    """A database URL fit for a log line or an error: its user's password and a `password=` query parameter (libpq takes
    one) written `***`."""
    return url_without_password(url.render_as_string(hide_password=False))


def _is_memory_sqlite(url: URL) -> bool:
    return url.database in (None, "", ":memory:") or (url.database or "").startswith("file::memory:")


def check_url(url: str) -> None:
    """LedgerConfigError unless `url` names a ledger that outlives the process: a SQLite file or PostgreSQL (psycopg 3).
    Parsing only, nothing is opened: the configuration's check at load."""
    parsed = _resolve_url(url)
    if parsed.get_backend_name() == "sqlite" and _is_memory_sqlite(parsed):
        raise LedgerConfigError(
            f"ledger url {url!r} is an in-memory SQLite database: each command and worker would get an empty ledger of its "
            f"own, gone when it exits; write sqlite:///PATH/ledger.db (or postgresql+psycopg://USER@HOST:PORT/DB)"
        )


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """An Engine for the ledger at `url`.

    PostgreSQL: a server that does not take a connection within PG_CONNECT_TIMEOUT_S fails it (an error, not a wait).

    SQLite: the file's folder is created, and every connection enforces foreign keys, uses WAL (readers
    never block the writer) and waits up to SQLITE_BUSY_TIMEOUT_S for a writer's lock. An in-memory
    database is kept on one shared connection so that it outlives a single checkout. A path that is there and is no
    regular file (/dev/null, a folder, a FIFO) is LedgerConfigError: SQLite failed on /dev/null with "disk I/O
    error", said as a full disk, or read it as an empty database with no schema.
    """
    parsed = _resolve_url(url)
    if parsed.get_backend_name() != "sqlite":
        if "connect_timeout" not in parsed.query:
            kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S, **kwargs.get("connect_args", {})}
        return create_engine(parsed, **kwargs)
    if _is_memory_sqlite(parsed):
        kwargs.setdefault("poolclass", StaticPool)
        kwargs.setdefault("connect_args", {"check_same_thread": False})
    else:
        path = Path(parsed.database).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and not path.is_file():
            kind = ("folder" if path.is_dir() else "character device" if path.is_char_device()
                    else "FIFO (a named pipe)" if path.is_fifo() else "special file")
            raise LedgerConfigError(f"ledger.url names {path}, a {kind}, not a regular file: it is no SQLite database; set "
                                    f"ledger.url to the ledger's file, sqlite:///PATH/ledger.db (`lorabatch db upgrade` creates it)")
    engine = create_engine(parsed, **kwargs)
    event.listen(engine, "connect", _sqlite_on_connect)
    return engine


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # The busy timeout first: switching to WAL takes the file's lock, and must wait as long as any statement.
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions on `engine` whose objects stay readable after commit (callers get detached rows)."""
    from sqlalchemy.orm import sessionmaker

    return sessionmaker(engine, expire_on_commit=False)


def read_snapshot(engine: Engine) -> Session:
    """A session on `engine` whose reads all see one snapshot of the ledger, for a report or invoice made of several.

    PostgreSQL: REPEATABLE READ (READ COMMITTED took each statement's own snapshot). SQLite: an explicit BEGIN, since
    its driver opens a transaction only before a write, so each read of a report was a transaction of its own; in
    WAL mode the snapshot is the file as of the first read, and writers go on meanwhile. Measured before: with a
    writer adding rows of the month, 59 of 60 `report reconcile` runs on PostgreSQL (60 of 60 on SQLite) showed an
    invoice_difference, the invoices read a moment after the sums they are checked against. The caller closes it,
    which rolls the read back.
    """
    from sqlalchemy.orm import Session

    if engine.dialect.name == "postgresql":
        return Session(engine.execution_options(isolation_level="REPEATABLE READ"))
    session = Session(engine)
    session.connection().exec_driver_sql("BEGIN")
    return session


def alembic_config(url: str | URL, script_location: str) -> Config:
    """An Alembic Config for the scripts at `script_location`, aimed at `url` (read by migrations/env.py)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", script_location)
    config.attributes["url"] = _resolve_url(url)
    return config


def upgrade(url: str | URL, revision: str = "head", *, script_location: str, currency: str | None = None,
            lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S, tries: int = MIGRATION_LOCK_TRIES) -> None:
    """Migrate the ledger at `url` up to `revision` (default: the newest) with the scripts at `script_location`; each
    lock within `lock_timeout_s`, `tries` times (MIGRATION_LOCK_TIMEOUT_S), else LedgerUnavailableError. `currency`
    (the caller's ledger.currency) labels price-list entries written before revision 0012, which refuses to guess one."""
    from alembic import command

    _migrate(command.upgrade, url, revision, script_location, lock_timeout_s, tries, currency)


def downgrade(url: str | URL, revision: str, *, script_location: str,
              lock_timeout_s: float = MIGRATION_LOCK_TIMEOUT_S, tries: int = MIGRATION_LOCK_TRIES) -> None:
    """Migrate the ledger at `url` down to `revision` ("base" removes every ledger table); locks as `upgrade` takes them."""
    from alembic import command

    _migrate(command.downgrade, url, revision, script_location, lock_timeout_s, tries)


def _migrate(command: Callable[..., None], url: str | URL, revision: str, script_location: str, lock_timeout_s: float,
             tries: int, currency: str | None = None) -> None:
    assert lock_timeout_s > 0 and tries >= 1, (lock_timeout_s, tries)
    config = alembic_config(url, script_location)
    config.attributes["lock_timeout_s"] = lock_timeout_s
    if currency is not None:
        config.attributes["currency"] = currency
    for attempt in range(1, tries + 1):
        try:
            command(config, revision)
            return
        except OperationalError as exc:
            if getattr(exc.orig, "sqlstate", None) != _LOCK_NOT_AVAILABLE:
                raise
            if attempt == tries:
                shown = shown_url(config.attributes["url"])
                raise LedgerUnavailableError(  # one line, the fix first: the CLI prints a message's first 300 characters
                    f"migrating the ledger at {shown} waited {lock_timeout_s:g} s for a lock on its tables {tries} times, "
                    f"and changed nothing: run it again once the session holding it ends (a long query such as a finance "
                    f"report, or an open transaction: see pg_stat_activity)") from exc
            time.sleep(MIGRATION_LOCK_PAUSE_S)


def head_revision(script_location: str) -> str:
    """The newest schema revision among the scripts at `script_location`."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory(script_location).get_current_head()
    assert head is not None, f"{script_location}/versions holds no revision"
    return head


def known_revisions(script_location: str) -> list[str]:
    """The schema revisions among the scripts at `script_location`, oldest first."""
    from alembic.script import ScriptDirectory

    return [script.revision for script in reversed(list(ScriptDirectory(script_location).walk_revisions()))]


def current_revision(engine: Engine) -> str | None:
    """The schema revision the database at `engine` is at; None when it was never migrated.

    Read from Alembic's version table directly, as MigrationContext.get_current_revision reads it, without
    loading Alembic (a worker or an admin command checks this at every start).
    """
    with engine.connect() as connection:
        if not inspect(connection).has_table(_VERSION_TABLE):
            return None
        found = connection.execute(text(f"SELECT version_num FROM {_VERSION_TABLE}")).scalars().all()
    assert len(found) <= 1, f"the ledger schema is at several heads {found}; migrations/versions is one line of revisions"
    return found[0] if found else None


def dialect_insert(dialect_name: str) -> Callable[..., Any]:
    """The insert() of `dialect_name` that has on_conflict_do_nothing / on_conflict_do_update.

    Both dialects spell INSERT ... ON CONFLICT the same way, each through its own insert(); the one in use
    is imported here, not at the top (a SQLite process never loads the PostgreSQL dialect).
    """
    assert dialect_name in ("postgresql", "sqlite"), f"no ledger support for dialect {dialect_name!r}"
    if dialect_name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    return insert
