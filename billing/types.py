"""Column types shared by the ledger's tables."""

from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal
from typing import Any

from sqlalchemy import DateTime, Numeric, String
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator, TypeEngine

_NINE_PLACES = Decimal("0.000000001")


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


class Money(TypeDecorator[Decimal]):
    """An exact price, nine places: `numeric(18, 9)` on PostgreSQL, fixed-point text on SQLite.

    SQLite has no decimal type; a NUMERIC column there keeps a double, exact to only ~15 significant
    digits, and a frozen invoice total of 1_234_567.123456789 would read back changed. Text keeps every
    digit. Money is never summed in SQL (sums are taken from integer microseconds and token counts), so
    the text form costs nothing.
    """

    impl = Numeric(18, 9)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(String(40))  # 29 integer digits, the point, 9 places and a sign
        return dialect.type_descriptor(self.impl)

    def process_bind_param(self, value: Decimal | None, dialect: Dialect) -> Decimal | str | None:
        if value is None:
            return None
        assert isinstance(value, Decimal), f"money must be a Decimal, got {value!r}"
        exact = value.quantize(_NINE_PLACES)
        assert exact == value, f"{value} has more than nine decimal places; round it with billing.cost first"
        return format(exact, "f") if dialect.name == "sqlite" else exact

    def process_result_value(self, value: Any, dialect: Dialect) -> Decimal | None:
        if value is None:
            return None
        return Decimal(value).quantize(_NINE_PLACES)


class Amount(Money):
    """A frozen invoice's or line's cost or revenue: `numeric(38, 9)` on PostgreSQL, fixed-point text on SQLite.

    Prices stay below 10^9 (billing.prices.check_price), but a month's amount is a price times usage: 30
    GPUs for a month at 40,000 IDR an hour is 864,000,000, and 36 of them passed numeric(18, 9)'s 10^9, so
    PostgreSQL refused to close the month that SQLite closed. 29 integer digits hold the most a line can
    reach: 2^63 us at a price under 10^9 per hour is under 2.6 * 10^18, 2^63 tokens at under 10^9 per
    million under 10^22.
    """

    impl = Numeric(38, 9)
    cache_ok = True
