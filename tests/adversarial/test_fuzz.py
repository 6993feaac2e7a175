"""Scenario 1, fuzz: hostile payloads into one running worker through the real broker and PostgreSQL.

Nothing a producer sends is fatal to a worker (DESIGN.md, "Reliability and security"): every message is
answered exactly once, by a result when its identity can be read and by a DLQ record otherwise; valid
jobs succeed, invalid ones fail with a code naming what to fix; DLQ records fit a message whatever they
carry; the ledger holds one row per answered job of a registered tenant and busy == attributed.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from billing import db
from migrations import SCRIPT_LOCATION
from tests.adversarial.accounting import account, dlq_problems, fill_tally, ledger_problems, result_problems, wait_conserved, wait_rows
from tests.adversarial.harness import Collector, Message, adversarial_settings, live_worker, produce, register_two_tenants
from tests.adversarial.payloads import TENANTS, Case, boundary_cases, drawn_cases, model_vocab, special_cases
from tests.db_fixtures import fresh_pg_schema
from tests.service_fixtures import open_services

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MAX_MESSAGE_BYTES = 65_536


def judge(cases: list[Case], sent, col: Collector, rows, total_rows: int, busy: tuple[int, int], lw, max_bytes: int, tally) -> list[str]:
    """Every way the run broke the invariants, one line each (empty: it held)."""
    acct = account(sent, col)
    problems = [f"lost: {x}" for x in acct.lost] + [f"answered twice: {x}" for x in acct.extra]
    problems += [f"result for no message sent: {x}" for x in acct.stray]
    problems += [f"unreadable record: {x}" for x in col.unreadable]
    by_source = {m.source: (m, c) for m, c in zip(sent, cases)}
    for source, records in acct.dlq.items():
        m, case = by_source.get(source, (None, None))
        if m is None:
            problems.append(f"DLQ record for no message sent: {source} {records[0].error}")
            continue
        if case.want not in ("dlq", "one"):
            problems.append(f"dead-lettered, want a {case.want} result: {m.describe()} -> {records[0].error.code}: {records[0].error.message[:200]}")
        elif case.codes is not None and case.want == "dlq" and records[0].error.code not in case.codes:
            problems.append(f"{m.describe()}: DLQ code {records[0].error.code}, want one of {sorted(case.codes)}")
    for record, size in col.dlq:
        m, _ = by_source.get((record.source_partition, record.source_offset), (None, None))
        if m is not None and record.source_topic == col.s.kafka.jobs_topic:
            problems += dlq_problems(record, size, m.value, max_bytes)
        elif size >= max_bytes:
            problems.append(f"DLQ record ({record.error.code}) of {size}B is over kafka.max_message_bytes={max_bytes}")
    answer_expect = {}
    ledger_expect = {}
    for m, case in zip(sent, cases):
        if m.identity is None:
            continue
        results = acct.results.get(m.identity, [])
        if case.want == "one":
            if any(r.status != "failed" for r in results):
                problems.append(f"{m.describe()}: undecodable job answered {results[0].status}, want failed or DLQ")
            answer_expect[m.identity] = ("result", None)
        elif case.want in ("succeeded", "failed", "result"):
            answer_expect[m.identity] = (case.want, case.codes)
        if m.identity[0] in TENANTS:
            ledger_expect[m.identity] = "result" if case.want in ("one", "result") else case.want
        else:
            ledger_expect[m.identity] = "none"
    problems += result_problems(acct.results, answer_expect)
    for identity, results in acct.results.items():
        for r in results:
            label = next((m.label for m in sent if m.identity == identity), "")
            if r.status == "failed" and not (r.error and r.error.code and r.error.message):
                problems.append(f"{identity} ({label}): failed without an error code and message")
    unbilled, double = ledger_problems(rows, ledger_expect, acct.results)
    expected_rows = sum(len(rs) for rs in rows.values())
    if total_rows != expected_rows:  # rows of no answered job: a dead-lettered message billed, say
        double.append(f"the ledger holds {total_rows} usage rows, {total_rows - expected_rows} beyond the answered jobs' {expected_rows}")
    problems += [f"ledger: {x}" for x in unbilled + double]
    if busy[0] != busy[1]:
        problems.append(f"busy {busy[0]} us != attributed {busy[1]} us for worker {lw.worker_id}")
    if not lw.alive():
        problems.insert(0, f"the worker is not alive: {lw.death()}")
    fill_tally(tally, sent, acct, col, [lw], unbilled, double, busy)
    return problems


async def run_batch(cases: list[Case], s, svc, tally, *, timeout_s: float = 150) -> list[str]:
    async with live_worker(s, svc) as lw, Collector(s) as col:
        sent = await produce(s, [c.message for c in cases])
        await col.until(lambda c: c.answered(sent) or not lw.alive(), timeout_s)
        await col.settle(1.5)
        answered = account(sent, col).results
        billed = [m.identity for m in sent if m.identity is not None and m.identity[0] in TENANTS and answered.get(m.identity)]
        rows = await wait_rows(svc.db, billed, 20 if lw.alive() else 2)
        busy = await wait_conserved(svc.db, lw.worker_id, 15 if lw.alive() else 2)
        total_rows = await asyncio.to_thread(svc.ledger.count_usage)
        return judge(cases, sent, col, rows, total_rows, busy, lw, s.kafka.max_message_bytes, tally)


def _report(problems: list[str]) -> str:
    return f"{len(problems)} problem(s), first: {problems[0]}\n" + "\n".join(problems[1:60])


async def test_fuzz_batch_answered_once_or_dead_lettered(tally, broker, tmp_path, demo_set, pg_database):
    """Hypothesis-drawn JSON values, bytes, valid jobs and jobs with one bad field, each numeric field at and
    beyond its limits, and JSON that breaks parsers (100k-deep nesting, 5000-digit ints, NaN, lone
    surrogates, NUL, RTL, non-UTF-8), all into one running worker: it stays alive, answers each message
    exactly once (valid: succeeded; invalid with a readable identity: failed with a code; else a DLQ
    record that identifies the whole message), bills each answered job of a registered tenant once with
    its real usage, and its busy time equals the time it attributed."""
    vocab = model_vocab(demo_set["model"])
    cases = drawn_cases(0, n_garbage=30, n_valid=40, n_bad=40, vocab=vocab)
    cases += boundary_cases(1000, vocab) + special_cases(2000)
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"])  # the default 1 MB: room for 100k-deep JSON
        svc = open_services(s)
        register_two_tenants(svc, demo_set)
        try:
            problems = await run_batch(cases, s, svc, tally)
        finally:
            svc.close()
    assert not problems, _report(problems)


def _sized_job(request_id: str, size: int) -> bytes:
    """A job whose JSON is exactly `size` bytes, its prompt padded."""
    head = {"request_id": request_id, "tenant_id": "acme", "max_new_tokens": 2, "prompt": ""}
    base = len(json.dumps(head).encode())
    value = json.dumps({**head, "prompt": "a" * (size - base)}).encode()
    assert len(value) == size, (len(value), size)
    return value


async def test_messages_at_and_over_the_size_limit(tally, broker, tmp_path, demo_set, pg_database):
    """With kafka.max_message_bytes = 64 KiB: a job of exactly the limit is read (and fails as too long a
    prompt), one byte more is dead-lettered as message_too_large, and so are ~1 MB ones; every DLQ record,
    even of a value at the limit that escapes six-fold in JSON, stays under the limit and keeps the whole
    value's length and sha256; the jobs behind them on the same partition are not blocked."""
    limit = MAX_MESSAGE_BYTES
    too_long = frozenset({"prompt_too_long"})
    too_large = frozenset({"message_too_large"})
    cases = [
        Case(Message(_sized_job("size-at-limit", limit), ("acme", "size-at-limit"), "job at the limit", partition=0), "failed", too_long),
        Case(Message(_sized_job("size-under", limit - 1), ("acme", "size-under"), "job 1 B under", partition=0), "failed", too_long),
        Case(Message(_sized_job("size-over", limit + 1), None, "job 1 B over", partition=0), "dlq", too_large),
        Case(Message(_sized_job("size-1mb", 1_000_000), None, "job of 1 MB", partition=0), "dlq", too_large),
        Case(Message(b"\x01" * limit, None, "control bytes at the limit", partition=0), "dlq", frozenset({"malformed_json"})),
        Case(Message(b"\xff" * limit, None, "non-UTF-8 at the limit", partition=0), "dlq", frozenset({"malformed_json"})),
        Case(Message(b'"' + b"\\u0001" * ((limit - 2) // 6) + b'"', None, "escaped string near the limit", partition=0), "dlq",
             frozenset({"malformed_json", "invalid_job"})),
        Case(Message(bytes(range(256)) * (limit // 256), None, "every byte, at the limit", partition=0), "dlq", frozenset({"malformed_json"})),
        Case(Message(b"\x01" * (limit + 1), None, "control bytes 1 B over", partition=0), "dlq", too_large),
        Case(Message(bytes(range(256)) * 3900, None, "every byte, ~1 MB", partition=0), "dlq", too_large),
    ]
    for i in range(6):  # behind the big ones on the same partition
        job = {"request_id": f"after-{i}", "tenant_id": "acme", "prompt": f"after the big ones {i}", "max_new_tokens": 3}
        cases.append(Case(Message(json.dumps(job).encode(), ("acme", job["request_id"]), job["request_id"], partition=0), "succeeded"))
    with fresh_pg_schema(pg_database) as url:
        db.upgrade(url, script_location=SCRIPT_LOCATION)
        s = await adversarial_settings(broker, tmp_path, url, demo_set["model"], **{"kafka.max_message_bytes": limit})
        svc = open_services(s)
        register_two_tenants(svc, demo_set)
        try:
            problems = await run_batch(cases, s, svc, tally, timeout_s=90)
        finally:
            svc.close()
    assert not problems, _report(problems)
