"""Alembic environment for the ledger schema.

Where the database comes from, first match wins; each is set by the process that runs the migration:
  1. a Connection in `config.attributes["connection"]` (callers that manage their own transaction),
  2. a URL in `config.attributes["url"]` (what `billing.db.upgrade` / `downgrade` pass),
  3. `alembic -x url=...` on the command line,
  4. `sqlalchemy.url` in alembic.ini (left empty in the repository's).
"""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import Connection, text
from sqlalchemy.engine import make_url

from billing.db import MIGRATION_LOCK_TIMEOUT_S, make_engine
from billing.errors import LedgerConfigError
from billing.models import Base

config = context.config
target_metadata = Base.metadata

# Any constant works; it only has to be the same for every process migrating this database.
_PG_MIGRATION_LOCK = 0x6C6F7261  # "lora"

if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)


def _url() -> str:
    url = (
        config.attributes.get("url")
        or context.get_x_argument(as_dictionary=True).get("url")
        or config.get_main_option("sqlalchemy.url")
    )
    if not url:
        raise LedgerConfigError(
            "no ledger database to migrate; pass one with `alembic -x url=sqlite:///.lorabatch/ledger.db upgrade head` "
            "(or `lorabatch db upgrade`, which takes ledger.url from the config)"
        )
    return url


def _configure(dialect_name: str, **kwargs: object) -> None:
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead, so downgrades work there too.
        render_as_batch=dialect_name == "sqlite",
        **kwargs,
    )


def _run_on(connection: Connection) -> None:
    dialect = connection.dialect.name
    if dialect == "sqlite":
        # A batch rebuild drops and renames tables, which enforced foreign keys would refuse; the pragma
        # only takes effect outside a transaction, hence before begin_transaction().
        connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
    _configure(dialect, connection=connection)
    if dialect == "sqlite" and not connection.connection.driver_connection.in_transaction:
        # pysqlite opens a transaction before INSERT/UPDATE/DELETE only: each CREATE, DROP and ALTER run before one
        # was committed on its own, so an upgrade that stopped part-way (killed, or refused by 0012) left a batch
        # rebuild's `_alembic_tmp_` table behind, and every later `db upgrade` failed on it ("table ... already
        # exists"). An explicit BEGIN makes the whole upgrade one transaction, as it is on PostgreSQL.
        connection.exec_driver_sql("BEGIN")
    with context.begin_transaction():
        if dialect == "postgresql":
            # Workers of a fleet start together; the lock makes the second wait and then find the schema
            # current, instead of racing to create the same tables. Released at commit.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
            # Then each table lock within a bound (billing.db.MIGRATION_LOCK_TIMEOUT_S says why), set after the
            # migration lock: a process waiting for another's migration waits as long as it takes.
            timeout_ms = int(config.attributes.get("lock_timeout_s", MIGRATION_LOCK_TIMEOUT_S) * 1000)
            connection.exec_driver_sql(f"SET LOCAL lock_timeout = {timeout_ms}")
        context.run_migrations()


def run_migrations_offline() -> None:
    url = make_url(_url())
    _configure(url.get_backend_name(), url=url, literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.connect() as connection:
            _run_on(connection)
            connection.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
