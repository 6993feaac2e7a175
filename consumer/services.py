"""Build the long-lived parts (database, registry, ledger, engine) from the settings, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine as SqlEngine

from billing.db import current_revision, head_revision, make_engine, session_factory
from billing.ledger import Ledger
from consumer.config import Settings
from consumer.registry import Registry
from engine.store import AdapterStore


class SchemaMissing(Exception):
    retriable = False


@dataclass
class Services:
    db: SqlEngine
    registry: Registry
    ledger: Ledger

    def close(self) -> None:
        self.db.dispose()


def open_services(settings: Settings, *, check_schema: bool = True) -> Services:
    db = make_engine(settings.ledger.url)
    if check_schema and (found := current_revision(db)) != head_revision():
        db.dispose()
        state = "has no schema yet" if found is None else f"is at revision {found}, not {head_revision()}"
        raise SchemaMissing(f"the ledger database {settings.ledger.url} {state}; run `lorabatch db upgrade` first")
    store = AdapterStore(Path(settings.store.adapter_dir), max_bytes=settings.engine.max_adapter_bytes)
    sessions = session_factory(db)
    return Services(db=db, registry=Registry(sessions, store), ledger=Ledger(db, settings.ledger))
