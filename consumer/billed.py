"""The billed copy of a batch's results: which of two answers to one request `lorabatch results` writes.

A request id of a tenant on two jobs partitions is run by two workers at once: each publishes its own result (both
land on one results partition, keyed by request id), and the ledger's unique key on (tenant_id, request_id) bills the
row written first, which keeps the body its worker published (`result_json`). The first copy on the topic may be the
other run's, with its own `cost`, `worker_id` and, sampled without a seed, `text`. Workers publish before they bill,
so the row's body is always a copy that was published; it is also what a resend of the request is answered with.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError

from billing.errors import LedgerError
from consumer.config import Settings
from consumer.schemas import Result
from consumer.services import SchemaMissing
from consumer.submit import retried

# How long a request whose copies disagree waits for its ledger row: a worker writes it right after it publishes (about
# a second: `worker.ledger_flush_ms` does not delay usage rows), so a row still missing after this is spooled (the
# ledger was away from that worker) or its worker stopped in between.
LEDGER_WAIT_S = 10.0
_CHUNK = 5_000  # keys per ledger read (Ledger.answered reads them in chunks of its own)
_LEDGER_ERRORS = (LedgerError, SchemaMissing, SQLAlchemyError, OSError)


@dataclass
class Billed:
    """What the ledger said of the results read: how many were swapped for its copy, and which could not be told."""

    replaced: list[str] = field(default_factory=list)  # request ids written as the ledger billed them
    unsettled: list[str] = field(default_factory=list)  # request ids with two different copies and no billed one known
    why: str | None = None  # why the ledger could not be read, when it could not


def prefer_billed(s: Settings, tenant_id: str, got: dict[str, Result], contested: set[str], wait_s: float = LEDGER_WAIT_S,
                  sleep: Callable[[float], None] = time.sleep) -> Billed:
    """Replace in `got` each result the ledger billed another copy of by that copy. `contested`: the request ids whose
    copies on the topic disagree; they wait up to `wait_s` for their row, the others are read once. A ledger that
    cannot be read leaves `got` as it is and says why; only the contested requests are then unsettled."""
    keys = [rid for rid, r in got.items() if not retried(r)]  # a retriable failure is not kept: it has no row
    billed = Billed()
    if not keys:
        return billed
    try:
        ledger = _open(s)
    except _LEDGER_ERRORS as e:
        billed.why = _reason(e)
        billed.unsettled = sorted(contested & set(keys))
        return billed
    deadline = time.monotonic() + wait_s
    pending = keys
    try:
        while True:
            missing = []
            for start in range(0, len(pending), _CHUNK):
                chunk = pending[start:start + _CHUNK]
                rows = ledger.answered((tenant_id, rid) for rid in chunk)
                for rid in chunk:
                    row = rows.get((tenant_id, rid))
                    if row is None:
                        if rid in contested:
                            missing.append(rid)
                        continue
                    copy = _body(row.result_json, tenant_id, rid)
                    if copy is None:  # a row older than the bodies' column, or not a result of this request
                        if rid in contested:
                            billed.unsettled.append(rid)
                    elif copy != got[rid]:
                        got[rid] = copy
                        billed.replaced.append(rid)
            if not missing or time.monotonic() >= deadline:
                break
            pending = missing
            sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    except _LEDGER_ERRORS as e:
        billed.why = _reason(e)
        missing = sorted(contested & set(keys) - set(billed.replaced))
    finally:
        ledger.close()
    if missing and billed.why is None:
        billed.why = f"no ledger row within {wait_s:g} s (a worker spooling while its ledger is away, or stopped)"
    billed.unsettled = sorted(set(billed.unsettled) | set(missing))
    return billed


def _body(text: str | None, tenant_id: str, request_id: str) -> Result | None:
    if not text:
        return None
    try:
        r = Result.model_validate_json(text)
    except ValidationError:
        return None
    return r if (r.tenant_id, r.request_id) == (tenant_id, request_id) else None


class _Reader:
    """The ledger opened for reading, closed with its engine."""

    def __init__(self, s: Settings):
        from billing.ledger import Ledger
        from consumer.services import open_ledger_db

        self.db = open_ledger_db(s)
        self.ledger = Ledger(self.db, s.ledger)

    def answered(self, keys):
        return self.ledger.answered(keys)

    def close(self) -> None:
        self.db.dispose()


def _open(s: Settings) -> _Reader:
    """The ledger at ledger.url; a SQLite file that is not there is not made (`results` runs where no ledger is, too)."""
    url = make_url(s.ledger.url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        path = Path(url.database).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"no ledger file at {path}")
    return _Reader(s)


def _reason(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__
