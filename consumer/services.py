"""Build the long-lived parts (database, registry, ledger, engine) from the settings, once."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine as SqlEngine

from billing.config import LedgerConfig
from billing.db import SCHEMA_REVISION, current_revision, make_engine, session_factory
from consumer.config import ConfigError, Settings

if TYPE_CHECKING:
    from billing.ledger import Ledger
    from consumer.registry import Registry


class SchemaMissing(Exception):
    retriable = False


@dataclass
class Services:
    db: SqlEngine
    registry: Registry
    ledger_config: LedgerConfig

    @cached_property
    def ledger(self) -> Ledger:
        """The ledger's writer, built on first use: the registry and report commands never write usage and skip its imports."""
        from billing.ledger import Ledger

        return Ledger(self.db, self.ledger_config)

    def close(self) -> None:
        self.db.dispose()


def shown_url(url: str) -> str:
    """A database URL fit for a log line or a message: its password masked."""
    from sqlalchemy.engine import make_url

    from billing.db import shown_url as shown

    try:
        return shown(make_url(url))
    except Exception:  # noqa: BLE001 - not a URL at all: show nothing of it that could be a secret
        return "(the configured ledger.url)"


def open_ledger_db(settings: Settings, *, check_schema: bool = True) -> SqlEngine:
    """The ledger database's engine; SchemaMissing unless its schema is at SCHEMA_REVISION (or `check_schema` is False).

    SQLAlchemy Core only: a command that reads a table or two with it never loads the ORM or the registry.
    """
    db = make_engine(settings.ledger.url)
    if check_schema and (found := current_revision(db)) != SCHEMA_REVISION:
        db.dispose()
        raise SchemaMissing(schema_mismatch(shown_url(settings.ledger.url), found))
    return db


def schema_mismatch(shown: str, found: str | None) -> str:
    """Why the ledger at `shown` (a URL fit to print) at revision `found` is not usable, and the fix: `db upgrade` for
    an older schema; for one this code has no script of (a newer lorabatch migrated it), a newer lorabatch, since
    `db upgrade` cannot move a ledger from a revision it does not know."""
    from billing.db import known_revisions
    from migrations import SCRIPT_LOCATION

    if found is None:
        return f"the ledger database {shown} has no schema yet; run `lorabatch db upgrade` first"
    if found not in known_revisions(SCRIPT_LOCATION):  # Alembic is loaded only here, on the way to an error
        return (f"the ledger database {shown} is at revision {found}, which this lorabatch does not know (newer than "
                f"its {SCHEMA_REVISION}?); upgrade lorabatch to the version that migrated it")
    return f"the ledger database {shown} is at revision {found}, not {SCHEMA_REVISION}; run `lorabatch db upgrade` first"


def open_services(settings: Settings, *, check_schema: bool = True) -> Services:
    from consumer.registry import Registry
    from engine.store import AdapterStore

    try:
        store = AdapterStore(Path(settings.store.adapter_dir), max_bytes=settings.engine.max_adapter_bytes)
    except OSError as e:  # said as the key to change: it was "File exists: ...", and a worker waited on it as for its ledger
        raise ConfigError(f"store.adapter_dir = {settings.store.adapter_dir!r} cannot be used as the adapter store's "
                          f"folder ({e.strerror or e}); set it to a folder this process can create and write") from e
    db = open_ledger_db(settings, check_schema=check_schema)
    sessions = session_factory(db)
    return Services(db=db, registry=Registry(sessions, store), ledger_config=settings.ledger)
