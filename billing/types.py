"""Column types shared by the ledger's tables."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import DateTime
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator


class UTCDateTime(TypeDecorator[datetime]):
    """`timestamptz` that always reads back as an aware UTC datetime, on every backend.

    PostgreSQL keeps the instant itself. SQLite has no timestamp type: SQLAlchemy writes the wall-clock
    digits and drops the offset, so a value is converted to UTC before it is written, and UTC is
    attached again when it is read.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        assert value.utcoffset() is not None, f"naive datetime {value!r}: the ledger stores instants, pass an aware one"
        value = value.astimezone(timezone.utc)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value.astimezone(timezone.utc)
