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
# The most microseconds any one record may carry in a time (a request's, a load's, a busy span's), ~8.9 years: a figure
# near it is a clock or accounting fault. Below it, a request's base + LoRA + routing, its KV credit's products and a
# month's sums stay within 64-bit integers on both backends; at the column's own bound, 2^63 - 1, the two times of one
# request overflowed the sum PostgreSQL computes (an error for every invoice of the month) and SQLite's (a float).
MAX_RECORD_US = 2**48
_TIMES = ("created_at", "started_at", "ended_at")
_IDS = ("tenant_id", "request_id")


def reject(what: str, field: str, value: object, fix: str) -> NoReturn:
    raise LedgerRecordError(f"{what}: {field}={value!r} cannot be written to the ledger; {fix}")


def _int_max(name: str, column_type: Integer) -> int:
    limit = _INT_MAX[BigInteger if isinstance(column_type, BigInteger) else Integer]
    return min(limit, MAX_RECORD_US) if name.endswith("_us") else limit


class RowChecker:
    """Every value of a row fits its column: timestamps aware, counts non-negative integers, text within its length."""

    def __init__(self, table: Table, names: Iterable[str]):
        present = set(names)
        columns = [c for c in table.columns if c.name in present]
        self._times = tuple(c.name for c in columns if c.name in _TIMES)
        self._ints = tuple((c.name, _int_max(c.name, c.type)) for c in columns if isinstance(c.type, Integer) and c.name not in _TIMES)
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
