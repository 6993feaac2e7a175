"""The end of an adversarial scenario: what each message got, what the ledger holds for it, the worker's busy
time against the time it attributed, and the closing note's row (Tally) that counts what went wrong.

`close_scenario` is the accounting every scenario ends with (the invariants of tests/adversarial/harness.py's
docstring); its `Closing.problems()` lists each broken one. The pieces it is made of (`account`,
`wait_rows`, `wait_conserved`, `ledger_problems`, `fill_tally`) serve the scenarios that judge more.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine as SqlEngine
from sqlalchemy import func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from billing.models import Busy, Usage
from consumer.schemas import DlqRecord, Result

if TYPE_CHECKING:
    from tests.adversarial.harness import Collector, LiveWorker, Sent

log = logging.getLogger("lorabatch.adversarial")

Identity = tuple[str, str]  # (tenant_id, request_id)


# ---------------------------------------------------------------- the closing note's table


@dataclass
class Tally:
    """One scenario's row of the closing note: what it threw at the worker and what went wrong."""

    scenario: str
    cases: int = 0  # messages sent
    lost: int = 0  # messages without any result or DLQ record
    double_billed: int = 0  # identities with more than one ledger row, or billed again on redelivery
    published_twice: int = 0  # messages answered more than once (results beyond their messages, DLQ copies)
    dead_workers: int = 0  # workers whose task had ended by the end of the scenario
    unbilled: int = 0  # identities of registered tenants without their ledger row (or with a wrong one)
    busy_gap_us: int = 0  # busy - attributed for the run's worker
    dlq: int = 0  # DLQ records read
    outcome: str = "unknown"
    failure: str = ""
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        self.notes.append(text[:500])


def append_report(path: str, tally: Tally) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("a") as f:
        f.write(json.dumps(asdict(tally), sort_keys=True) + "\n")


# ---------------------------------------------------------------- each message's outcomes


@dataclass
class Accounting:
    lost: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)  # answered more often than sent
    stray: list[str] = field(default_factory=list)  # results for an identity nobody sent
    results: dict[Identity, list[Result]] = field(default_factory=dict)
    dlq: dict[tuple[int, int], list[DlqRecord]] = field(default_factory=dict)


def account(sent: list[Sent], col: Collector) -> Accounting:
    """Each message's outcomes: results by identity (shared among duplicate messages), DLQ records by source."""
    out = Accounting()
    jobs_topic = col.s.kafka.jobs_topic
    for record, _ in col.dlq:
        if record.source_topic == jobs_topic:
            out.dlq.setdefault((record.source_partition, record.source_offset), []).append(record)
    by_identity: dict[Identity, list[Result]] = defaultdict(list)
    for r in col.results:
        by_identity[(r.tenant_id, r.request_id)].append(r)
    groups: dict[object, list[Sent]] = defaultdict(list)
    for m in sent:
        groups[m.identity if m.identity is not None else ("offset", m.source)].append(m)
    for key, members in groups.items():
        results = by_identity.get(key, []) if members[0].identity is not None else []
        dlq = [d for m in members for d in out.dlq.get(m.source, [])]
        got, want = len(results) + len(dlq), len(members)
        if got < want:
            out.lost.extend(m.describe() for m in members[: want - got])
        if got > want:
            out.extra.append(f"{members[0].describe()}: {len(results)} results + {len(dlq)} DLQ records for {want} message(s)")
        for m in members:
            if len(out.dlq.get(m.source, [])) > 1:
                out.extra.append(f"{m.describe()}: {len(out.dlq[m.source])} DLQ records")
        if members[0].identity is not None:
            out.results[members[0].identity] = results
    sent_ids = {m.identity for m in sent if m.identity is not None}
    for identity, results in by_identity.items():
        if identity not in sent_ids:
            out.stray.append(f"{identity}: {len(results)} result(s), e.g. {results[0].error}")
    return out


def dlq_problems(record: DlqRecord, size: int, original: bytes | None, max_bytes: int) -> list[str]:
    """What is wrong with one DLQ record of `original`: its size, its fingerprint of the whole value, its excerpt."""
    raw = original or b""
    problems = []
    where = f"DLQ record of {record.source_partition}:{record.source_offset} ({len(raw)}B, {record.error.code})"
    if size >= max_bytes:
        problems.append(f"{where} is {size}B, not under kafka.max_message_bytes={max_bytes}")
    if getattr(record, "raw_bytes", None) != len(raw):
        problems.append(f"{where}: raw_bytes={getattr(record, 'raw_bytes', None)!r}, want {len(raw)}")
    if getattr(record, "raw_sha256", None) != hashlib.sha256(raw).hexdigest():
        problems.append(f"{where}: raw_sha256={getattr(record, 'raw_sha256', None)!r}, want the sha256 of the whole value")
    try:
        head = base64.b64decode(record.raw_b64, validate=True)
    except ValueError:
        problems.append(f"{where}: raw_b64 is not base64")
    else:
        if not raw.startswith(head):
            problems.append(f"{where}: raw_b64 holds {len(head)}B that are not a prefix of the message")
        if len(raw) > 0 and not head:
            problems.append(f"{where}: raw_b64 keeps nothing of the message")
    if not isinstance(record.raw, str):
        problems.append(f"{where}: raw is not text")
    return problems


def result_problems(results: dict[Identity, list[Result]], expect: dict[Identity, tuple[str, frozenset | None]]) -> list[str]:
    """Each identity's results against (status wanted or "result" for either, allowed error codes or None)."""
    problems = []
    for identity, (want, codes) in expect.items():
        for r in results.get(identity, []):
            if want in ("succeeded", "failed") and r.status != want:
                problems.append(f"{identity}: {r.status} ({r.error}), want {want}")
                continue
            if r.status == "failed":
                code = r.error.code if r.error else None
                if code == "engine_error":
                    problems.append(f"{identity}: engine_error (a bug on the worker's side): {r.error.message}")
                elif codes is not None and code not in codes:
                    problems.append(f"{identity}: failed with {code}, want one of {sorted(codes)}: {r.error.message if r.error else ''}")
            if r.status == "succeeded" and not (r.usage.output_tokens > 0 and r.cost.base_ms > 0):
                problems.append(f"{identity}: succeeded without usage: {r.usage}, {r.cost}")
    return problems


# ---------------------------------------------------------------- the ledger


def usage_rows(db: SqlEngine, identities) -> dict[Identity, list[Usage]]:
    wanted = set(identities)
    tenants = {t for t, _ in wanted}
    with Session(db) as session:
        rows = session.scalars(select(Usage).where(Usage.tenant_id.in_(tenants))).all()
        session.expunge_all()
    out: dict[Identity, list[Usage]] = {i: [] for i in wanted}
    for row in rows:
        if (row.tenant_id, row.request_id) in wanted:
            out[(row.tenant_id, row.request_id)].append(row)
    return out


def row_dict(row: Usage) -> dict:
    return {c.key: getattr(row, c.key) for c in Usage.__table__.columns}


def busy_and_attributed(db: SqlEngine, worker_id: str) -> tuple[int, int]:
    with Session(db) as session:
        busy = session.scalar(select(func.sum(Busy.busy_us)).where(Busy.worker_id == worker_id))
        attributed = session.scalar(select(func.sum(Usage.base_us + Usage.lora_us)).where(Usage.worker_id == worker_id))
    return int(busy or 0), int(attributed or 0)


async def wait_conserved(db: SqlEngine, worker_id: str, timeout_s: float = 15.0) -> tuple[int, int]:
    """(busy, attributed) of the worker once they agree, or as they stand when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            busy, attributed = await asyncio.to_thread(busy_and_attributed, db, worker_id)
        except (SQLAlchemyError, OSError) as e:  # the database may still be coming back
            log.info("conservation query failed (%s); retrying", e)
            busy, attributed = -1, 0
        if busy == attributed and busy >= 0 or time.monotonic() > deadline:
            return busy, attributed
        await asyncio.sleep(0.2)


async def wait_rows(db: SqlEngine, identities, timeout_s: float) -> dict[Identity, list[Usage]]:
    """The identities' ledger rows once each has one, or as they stand when the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rows = await asyncio.to_thread(usage_rows, db, identities)
        except (SQLAlchemyError, OSError) as e:  # the database may still be coming back
            log.info("ledger query failed (%s); retrying", e)
            rows = None
        if rows is not None and all(rows.values()) or time.monotonic() > deadline:
            return rows or {i: [] for i in identities}
        await asyncio.sleep(0.3)


def ledger_problems(rows: dict[Identity, list[Usage]], expect: dict[Identity, str], results: dict[Identity, list[Result]]) -> tuple[list[str], list[str]]:
    """(unbilled, double billed): each identity of `expect` ("succeeded", "failed", "none" or "result" -- the
    status its result got) against its ledger rows."""
    unbilled, double = [], []
    for identity, want in expect.items():
        got = rows.get(identity, [])
        if want == "result":
            published = results.get(identity, [])
            want = published[0].status if published else "none"
        if want == "none":
            if got:
                double.append(f"{identity}: {len(got)} ledger row(s), want none")
            continue
        if len(got) > 1:
            double.append(f"{identity}: {len(got)} ledger rows")
        if not got:
            unbilled.append(f"{identity}: no ledger row, want one {want}")
            continue
        row = got[0]
        if row.status != want:
            unbilled.append(f"{identity}: ledger row {row.status} ({row.error_code}), want {want}")
        elif want == "succeeded" and not (row.output_tokens > 0 and row.base_us > 0):
            unbilled.append(f"{identity}: succeeded row without its usage (output_tokens={row.output_tokens}, base_us={row.base_us})")
    return unbilled, double


# ---------------------------------------------------------------- the end of a scenario


def fill_tally(t: Tally, sent: list[Sent], acct: Accounting, col: Collector, workers: list[LiveWorker],
               unbilled: list[str] = (), double: list[str] = (), busy: tuple[int, int] | None = None) -> None:
    t.cases = len(sent)
    t.lost = len(acct.lost)
    t.published_twice = len(acct.extra) + len(acct.stray)
    t.dead_workers = sum(not w.alive() for w in workers)
    t.unbilled = len(unbilled)
    t.double_billed = len(double)
    t.dlq = len(col.dlq)
    if busy is not None:
        t.busy_gap_us = busy[0] - busy[1]
    for w in workers:
        if not w.alive():
            t.note(f"worker {w.worker_id} {w.death()}")
    for text in [*acct.lost[:3], *acct.extra[:3], *acct.stray[:3], *list(unbilled)[:3], *list(double)[:3], *col.unreadable[:3]]:
        t.note(text)


@dataclass
class Closing:
    """What the end of a scenario found: each message's outcomes, the ledger's rows and verdict on them, the
    worker's (busy, attributed) microseconds, and how it stood (alive, or how it ended)."""

    acct: Accounting
    rows: dict[Identity, list[Usage]]
    unbilled: list[str]
    double: list[str]
    busy: tuple[int, int]
    death: str  # "alive", or how the worker's task ended

    def problems(self) -> list[str]:
        """Every invariant of the harness's docstring the scenario broke, one line each (empty: all held): a dead
        worker, a message lost or answered more than once, a result for no message sent, an identity unbilled or
        billed twice, busy time unequal to the time attributed."""
        a = self.acct
        out = [] if self.death == "alive" else [f"the worker is not alive: {self.death}"]
        out += [f"lost: {x}" for x in a.lost] + [f"answered more than once: {x}" for x in a.extra]
        out += [f"result for no message sent: {x}" for x in a.stray]
        out += [f"unbilled: {x}" for x in self.unbilled] + [f"billed twice: {x}" for x in self.double]
        if self.busy[0] != self.busy[1]:
            out.append(f"busy {self.busy[0]} us != attributed {self.busy[1]} us")
        return out


async def close_scenario(tally: Tally, sent: list[Sent], col: Collector, db: SqlEngine, lw: LiveWorker, *,
                         billed: list[Identity] | None = None, expect: dict[Identity, str] | None = None,
                         earlier: dict[Identity, list[Result]] | None = None, rows_s: float = 15.0,
                         busy_s: float = 15.0) -> Closing:
    """The accounting a scenario ends with, once its results are read: the ledger rows of `billed` (default: every
    identity sent) once each has one (up to `rows_s`), the worker's busy time once it equals what it attributed
    (up to `busy_s`), each message's outcomes in `col`, the ledger judged against `expect` (default: every billed
    identity "succeeded"; "result" judges against its result here or in `earlier`, another reader's), and the
    tally filled. Call it while the worker runs: whether it is alive is read here."""
    billed = [m.identity for m in sent if m.identity is not None] if billed is None else billed
    rows = await wait_rows(db, billed, rows_s)
    busy = await wait_conserved(db, lw.worker_id, busy_s)
    acct = account(sent, col)
    expect = {i: "succeeded" for i in billed} if expect is None else expect
    unbilled, double = ledger_problems(rows, expect, {**(earlier or {}), **acct.results})
    fill_tally(tally, sent, acct, col, [lw], unbilled, double, busy)
    return Closing(acct, rows, unbilled, double, busy, lw.death())
