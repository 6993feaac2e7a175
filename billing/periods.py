"""Billing periods: a UTC calendar month written "YYYY-MM"."""

from __future__ import annotations

import re
from datetime import datetime, timezone

from billing.errors import InvalidPeriodError

_PERIOD = re.compile(r"[0-9]{4}-(0[1-9]|1[0-2])")  # [0-9], not \d: \d also takes "２０２６"


def period_of(moment: datetime) -> str:
    """The period `moment` falls in, by its UTC month (23:30 on Jan 31 at -05:00 is already February)."""
    assert moment.utcoffset() is not None, f"naive datetime {moment!r}: billing periods need an aware one"
    return moment.astimezone(timezone.utc).strftime("%Y-%m")


def check_period(period: str) -> str:
    """`period` itself when it is a well-formed "YYYY-MM", else InvalidPeriodError."""
    if not isinstance(period, str) or _PERIOD.fullmatch(period) is None:
        raise InvalidPeriodError(
            f"period={period!r} is not a billing period; write it as YYYY-MM, "
            f"a four-digit year and a zero-padded month 01-12, e.g. '2026-01'"
        )
    return period
