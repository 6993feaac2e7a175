"""Build the long-lived parts (database, registry, ledger, engine) from the settings, once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Engine as SqlEngine
from sqlalchemy import inspect

from billing.db import make_engine, session_factory
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
    if check_schema and not inspect(db).has_table("usage"):
        db.dispose()
        raise SchemaMissing(
            f"the ledger database {settings.ledger.url} has no schema yet; run `lorabatch db upgrade` first"
        )
    store = AdapterStore(Path(settings.store.adapter_dir), max_bytes=settings.engine.max_adapter_bytes)
    sessions = session_factory(db)
    return Services(db=db, registry=Registry(sessions, store), ledger=Ledger(db, settings.ledger))
