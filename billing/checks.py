"""Checks that a record fits its table before anything is written: one bad record fails its whole batch.

Compiled once per (table, record type): the checks run for every row of every flush, so each is a
type test and a comparison, and the error message (which names the record, the field and the fix) is
only built when a check fails.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, NoReturn

from sqlalchemy import BigInteger, Integer, String, Table

from billing.errors import LedgerRecordError

STATUSES = ("succeeded", "failed")
ADAPTER = re.compile(r"[^@\s]+@\d+")  # "name@version"
SHA256 = re.compile(r"[0-9a-f]{64}")
_INT_MAX = {Integer: 2**31 - 1, BigInteger: 2**63 - 1}
_TIMES = ("created_at", "started_at", "ended_at")
_IDS = ("tenant_id", "request_id")


def reject(what: str, field: str, value: object, fix: str) -> NoReturn:
    raise LedgerRecordError(f"{what}: {field}={value!r} cannot be written to the ledger; {fix}")


class RowChecker:
    """Every value of a row fits its column: timestamps aware, counts non-negative integers, text within its length."""

    def __init__(self, table: Table, names: Iterable[str]):
        present = set(names)
        columns = [c for c in table.columns if c.name in present]
        self._times = tuple(c.name for c in columns if c.name in _TIMES)
        self._ints = tuple((c.name, _INT_MAX[BigInteger if isinstance(c.type, BigInteger) else Integer]) for c in columns
                           if isinstance(c.type, Integer) and c.name not in _TIMES)
        self._strs = tuple((c.name, c.type.length or 1 << 62, bool(c.nullable)) for c in columns
                           if isinstance(c.type, String) and c.name not in _TIMES)
        self._ids = tuple(name for name in _IDS if name in present)

    def check(self, row: Mapping[str, Any], what: Callable[[], str]) -> None:
        for name in self._times:
            value = row[name]
            if not isinstance(value, datetime) or value.utcoffset() is None:
                reject(what(), name, value, "pass a timezone-aware datetime, e.g. datetime.now(timezone.utc)")
        for name, limit in self._ints:
            value = row[name]
            if type(value) is not int or not 0 <= value <= limit:
                reject(what(), name, value, f"pass an integer from 0 to {limit} (times in microseconds)")
        for name, length, nullable in self._strs:
            value = row[name]
            if value is None:
                if not nullable:
                    reject(what(), name, value, "pass a string")
            elif type(value) is not str or len(value) > length:
                reject(what(), name, value, f"pass a string of at most {length} characters")
        for name in self._ids:
            if not row[name]:
                reject(what(), name, row[name], "pass a non-empty id")
