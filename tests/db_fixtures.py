"""Database fixtures: an empty ledger per backend (SQLite file, the machine's PostgreSQL), migrated on request.

PostgreSQL gets one fresh database per test session, dropped at the end, and one schema per test inside it.
Deselect PostgreSQL with `-m "not postgres"`; when it is selected but down, the tests error, not skip.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError

from billing import db
from migrations import SCRIPT_LOCATION

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


@pytest.fixture(scope="session")
def pg_database() -> Iterator[URL]:
    """A fresh PostgreSQL database for this test session, dropped (connections and all) at the end."""
    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"lorabatch_test_{secrets.token_hex(6)}"
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
    except OperationalError as exc:
        admin.dispose()
        pytest.fail(
            f"PostgreSQL at {PG_ADMIN_URL} is not reachable ({exc.orig}); start it with "
            f"`pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` "
            f'or deselect these tests with -m "not postgres"',
            pytrace=False,
        )
    try:
        yield make_url(PG_ADMIN_URL).set(database=name)
    finally:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.dispose()


@contextmanager
def fresh_pg_schema(database: URL) -> Iterator[str]:
    """The URL of an empty schema of `database` (first on every connection's search_path), dropped after."""
    schema = f"t_{secrets.token_hex(6)}"
    admin = create_engine(database, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        yield database.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
    finally:
        admin.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty ledger database, one per backend; the SQLite file's folder does not exist yet."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'not-yet' / 'ledger.db'}"
        return
    with fresh_pg_schema(request.getfixturevalue("pg_database")) as url:
        yield url


# For a test whose subject is the worker, not the ledger (a broker's, an engine's or Redis's bad day, codecs, partitions):
# one backend, the production one. The ledger's own tests and the main end-to-end test run on both.
ONE_LEDGER = pytest.mark.parametrize("db_url", [pytest.param("postgresql", marks=pytest.mark.postgres)], indirect=True)


@pytest.fixture
def migrated_url(db_url: str) -> str:
    db.upgrade(db_url, script_location=SCRIPT_LOCATION)
    return db_url


@pytest.fixture
def engine(migrated_url: str) -> Iterator[Engine]:
    engine = db.make_engine(migrated_url)
    yield engine
    engine.dispose()


@pytest.fixture
def ledger_url(migrated_url: str) -> str:
    """A migrated, empty ledger (each backend in turn)."""
    return migrated_url
