"""A scratch database for a bench: a fresh PostgreSQL schema of the database a URL names, or a fresh SQLite file beside
the one it names, removed at the end, so that a bench never touches existing data."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sqlalchemy import create_engine

from billing import db


@contextmanager
def scratch_database(url: str) -> Iterator[str]:
    """A URL of an empty database to fill: a fresh PostgreSQL schema or a fresh SQLite file, removed after."""
    parsed = db._resolve_url(url)
    if parsed.get_backend_name() == "sqlite":
        assert parsed.database and parsed.database != ":memory:", "bench a SQLite file, e.g. sqlite:///bench.db"
        path = Path(f"{parsed.database}.bench-{secrets.token_hex(4)}")
        try:
            yield parsed.set(database=str(path)).render_as_string(hide_password=False)
        finally:
            for leftover in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
                leftover.unlink(missing_ok=True)
        return
    schema = f"lorabatch_bench_{secrets.token_hex(4)}"
    admin = create_engine(parsed, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'CREATE SCHEMA "{schema}"')
        try:
            yield parsed.update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP SCHEMA "{schema}" CASCADE')
    finally:
        admin.dispose()
