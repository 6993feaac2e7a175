"""Billing periods: a UTC calendar month written "YYYY-MM"."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from billing.errors import InvalidPeriodError

_PERIOD = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])")  # [0-9], not \d: \d also takes "２０２６"


def period_of(moment: datetime) -> str:
    """The period `moment` falls in, by its UTC month (23:30 on Jan 31 at -05:00 is already February)."""
    assert moment.utcoffset() is not None, f"naive datetime {moment!r}: billing periods need an aware one"
    utc = moment.astimezone(timezone.utc)
    return f"{utc.year:04d}-{utc.month:02d}"


def check_period(period: str) -> str:
    """`period` itself when it is a well-formed "YYYY-MM", else InvalidPeriodError."""
    if not isinstance(period, str) or _PERIOD.fullmatch(period) is None:
        raise InvalidPeriodError(
            f"period={period!r} is not a billing period; write it as YYYY-MM, "
            f"a four-digit year and a zero-padded month 01-12, e.g. '2026-01'"
        )
    return period


def period_start(period: str) -> datetime:
    """The first instant of `period`: midnight UTC of its first day."""
    year, month = map(int, check_period(period).split("-"))
    return datetime(year, month, 1, tzinfo=timezone.utc)


def next_period(period: str) -> str:
    """The month after `period` ("2026-12" -> "2027-01")."""
    year, month = map(int, check_period(period).split("-"))
    return f"{year + month // 12:04d}-{month % 12 + 1:02d}"


def period_end(period: str) -> datetime:
    """The first instant after `period`: midnight UTC of the next month's first day."""
    return period_start(next_period(period))
