"""Floods a producer can send a worker that runs for weeks: bad messages by the thousand, one request id resent in a
loop while it waits, a stream of long answers. None may grow the worker's log or its memory past a stated bound."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import tracemalloc
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from consumer.config import Settings
from consumer.delivery import Outcome
from consumer.answers import answer_bytes
from consumer.intake import ANSWER_BYTES, Intake, estimate_tokens
from consumer.logs import Repeats
from consumer.metrics import WorkerMetrics
from consumer.scheduler import Pending, Scheduler
from consumer.schemas import Result, Usage, parse_job
from consumer.worker import Worker

TP = TopicPartition("jobs", 0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _intake(settings: Settings | None = None) -> tuple[Intake, list]:
    intake = Intake(settings or Settings(), WorkerMetrics(), "w1", None, None, None, None, asyncio.Event(),
                    SimpleNamespace(rules=[], tenants={}))
    emitted: list = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)
    return intake, emitted


def _message(offset: int, value: bytes) -> SimpleNamespace:
    return SimpleNamespace(topic=TP.topic, partition=TP.partition, offset=offset, timestamp=1_000 + offset, value=value,
                           key=None, headers=())


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lorabatch.worker"]


# (time, event): ("note", code) notes a DLQ record of that code, ("flush",) lets the worker's loop flush
REPEATS_CASES = [
    ("nothing noted, nothing written", [(0, ("flush",))], []),
    ("one record is one line", [(0, ("note", "malformed_json"))], ["dlq 0 malformed_json"]),
    ("a burst: its first, then one count once due", [
        (0, ("note", "malformed_json")), (1, ("note", "malformed_json")), (2, ("note", "message_too_large")),
        (3, ("note", "malformed_json")), (5, ("flush",)), (10, ("flush",)), (11, ("flush",)),
    ], ["dlq 0 malformed_json", "3 more DLQ records in the last 10 s (malformed_json 2, message_too_large 1); the last: dlq 3 "
        "malformed_json"]),
    ("a flood: a count every interval at most, counted by the next record when no flush came", [
        (0, ("note", "a")), *[(t / 10, ("note", "a")) for t in range(1, 250)], (25, ("flush",)),
    ], ["dlq 0 a", "100 more DLQ records in the last 10 s (a 100); the last: dlq 10 a",
        "100 more DLQ records in the last 10 s (a 100); the last: dlq 20 a"]),
    ("a record after a quiet spell is a line of its own again", [
        (0, ("note", "a")), (3, ("note", "b")), (10, ("flush",)), (30, ("note", "c")),
    ], ["dlq 0 a", "1 more DLQ records in the last 10 s (b 1); the last: dlq 3 b", "dlq 30 c"]),
]


@pytest.mark.parametrize("events, expected", [c[1:] for c in REPEATS_CASES], ids=[c[0] for c in REPEATS_CASES])
def test_repeats_write_the_first_then_one_count_per_interval(events, expected, caplog):
    """A repeated event writes its first line as it comes and then at most one line per interval, counting the rest by
    kind: the log of a flood grows with time, not with the traffic."""
    clock = Clock()
    repeats = Repeats("DLQ records", logging.getLogger("lorabatch.worker"), every_s=10.0, clock=clock)
    caplog.set_level(logging.WARNING, "lorabatch.worker")
    for at, event in events:
        clock.t = 100.0 + at
        if event[0] == "note":
            repeats.note(event[1], f"dlq {at:g} {event[1]}")
        else:
            repeats.flush()
    assert _lines(caplog) == expected


def test_a_flood_of_bad_messages_writes_two_log_lines_and_every_dlq_record(caplog):
    """3,000 messages that are not JSON: each is dead-lettered and counted in lorabatch_dlq_total, and the worker's log
    has a line for the first and one counting the rest (it had 3,000 lines, one per message, in about a second)."""
    intake, emitted = _intake()
    caplog.set_level(logging.WARNING, "lorabatch.worker")
    asyncio.run(intake.ingest([(TP, _message(i, b"not json %d" % i), 1) for i in range(3_000)]))
    assert len(emitted) == 3_000 and all(o.dlq is not None and o.dlq.error.code == "malformed_json" for o in emitted)
    assert intake.metrics.dlq.labels("malformed_json")._value.get() == 3_000
    (first,) = _lines(caplog)
    assert first.startswith("dlq jobs:0@0 not valid UTF-8 JSON")
    intake.dlq_log.flush(force=True)  # the worker's stop
    first, count = _lines(caplog)
    assert count.startswith("2999 more DLQ records in the last ") and "(malformed_json 2999); the last: dlq jobs:0@2999 " in count


def _job(request_id: str, prompt: str) -> bytes:
    return json.dumps({"v": 1, "request_id": request_id, "tenant_id": "acme", "prompt": prompt, "max_new_tokens": 4}).encode()


def test_copies_of_a_waiting_request_are_counted_until_its_answer():
    """A request id resent while its first copy waits (for its tenant's quota, say) parks each resend until the first is
    answered; the parked copies and their tokens are counted, and the count goes back to 0 when they are answered."""
    intake, emitted = _intake()
    key = ("acme", "r1")
    intake.running[key] = []  # the first copy is queued in the scheduler
    value = _job("r1", "x" * 3_000)
    asyncio.run(intake.ingest([(TP, _message(i, value), 1) for i in range(1, 51)]))
    assert not emitted and len(intake.running[key]) == 50
    assert (intake.parked, intake.parked_tokens) == (50, 50 * estimate_tokens(parse_job(value), Settings().engine))
    intake.answer(key, Outcome(TP, 0, result=Result(request_id="r1", tenant_id="acme", status="succeeded"), epoch=1), keep=False)
    assert len(emitted) == 51 and key not in intake.running
    assert (intake.parked, intake.parked_tokens) == (0, 0)


def test_copies_left_on_a_revoke_are_no_longer_counted():
    """The first copy's partition was revoked, with its copies: they are the new owner's, and no longer counted here."""
    intake, emitted = _intake()
    key = ("acme", "r1")
    intake.running[key] = []
    asyncio.run(intake.ingest([(TP, _message(i, _job("r1", "hello")), 1) for i in range(1, 6)]))
    assert intake.parked == 5
    asyncio.run(intake.orphaned(key, {TP}))
    assert (intake.parked, intake.parked_tokens) == (0, 0) and key not in intake.running and not emitted


@pytest.mark.parametrize("queued, parked, parked_tokens, paused", [
    (0, 0, 0, False),
    (3, 6, 90, False),  # 9 jobs, under the bound of 10
    (3, 7, 90, True),  # 10 jobs, 7 of them copies
    (0, 10, 0, True),  # copies alone
    (0, 1, 1_000, True),  # one copy of a prompt at the token bound
])
def test_waiting_copies_pause_fetching_as_queued_jobs_do(queued, parked, parked_tokens, paused):
    """Backpressure counts the copies waiting for a request's first answer with the queued jobs and tokens: a producer
    resending one request id in a loop while it waited for its quota had 6,000 copies parked in the worker's memory,
    with fetching never paused (worker.max_queued_jobs 2048)."""
    why = _backpressure(queued=queued, parked=parked, parked_tokens=parked_tokens)
    assert (why is not None) == paused, why
    if paused:
        assert f"({parked} of them copies of a request id already here, waiting for its answer)" in why


def _backpressure(queued: int = 0, parked: int = 0, parked_tokens: int = 0, unsent: int = 0) -> str | None:
    """Why the worker's partitions are held with this much work here (max_queued_jobs 10, max_queued_tokens 1,000)."""
    scheduler = Scheduler(4, 8_192, 4)
    for _ in range(queued):
        scheduler.push(Pending("acme", None, 10, 0.0, None, partition=TP))
    held: list = []
    worker = SimpleNamespace(
        s=Settings.model_validate({"worker": {"max_queued_jobs": 10, "max_queued_tokens": 1_000}}),
        deliverer=SimpleNamespace(schema_behind=False, outbox=[None] * unsent), spool=SimpleNamespace(full=False),
        scheduler=scheduler, _in_engine={}, intake=SimpleNamespace(parked=parked, parked_tokens=parked_tokens),
        partitions=SimpleNamespace(hold=held.append))
    Worker._backpressure(worker)
    (why,) = held
    return why


@pytest.mark.parametrize("queued, unsent, why", [
    (0, 9, None),
    (9, 9, None),  # a burst of answers on its way out beside a queue: each under the bound of 10
    (0, 10, "10 answers wait to be published and billed"),
    (10, 12, "12 answers wait to be published and billed"),
])
def test_answers_waiting_for_delivery_pause_fetching(queued, unsent, why):
    """Answers that wait to be published and billed have a bound of their own: with the ledger down and the spool's disk
    full, a worker fetched on while its deliveries waited, 42,000 jobs in flight (max_queued_jobs 2048) and its RSS from
    299 to 486 MB, growing with every job produced; the jobs queued for the engine paused it only briefly, since the
    engine went on answering them into the waiting outbox."""
    assert _backpressure(queued=queued, unsent=unsent) == why


def _answer(i: int, tokens: int, text: str) -> Result:
    ids = random.Random(i).choices(range(300, 128_000), k=tokens)  # ids past 256 are int objects of their own
    return Result(request_id=f"req-{i:08d}", tenant_id="acme", batch_id="b-1", adapter="support@1", status="succeeded",
                  text=text * tokens, output_ids=ids, usage=Usage(input_tokens=10, output_tokens=tokens, cached_tokens=0),
                  route="tenant_default", worker_id="w-1")


@pytest.mark.parametrize("tokens, text", [(0, ""), (16, "word"), (1_200, "wo"), (1_700, "\u00e9"), (300, "\u4e2d"), (200, "\U0001f600")])
def test_an_answer_is_counted_at_what_it_takes_in_memory(tokens, text):
    """The size the answer cache counts an answer at is no less than what its objects take (tracemalloc, 5% slack): at 8
    bytes an output id and 1 a character, an answer of 1,200 tokens was counted at 12 KB and took 45 KB."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [_answer(i, tokens, text) for i in range(200)]
        taken = (tracemalloc.get_traced_memory()[0] - before) / len(kept)
    finally:
        tracemalloc.stop()
    assert taken <= 1.05 * answer_bytes(kept[0]), (taken, answer_bytes(kept[0]))


@pytest.mark.parametrize("tokens, text, kept", [
    (16, "word", 1_000),  # short answers: the count bounds the cache
    (1_200, "wo", 306),  # long ones: the bytes do (1,000 x 16 KiB over 53.4 KB each)
    (2_000, "w", 0),  # over 64 KiB each: read back from the spool or the ledger instead
])
def test_the_answer_cache_holds_its_count_and_its_bytes(tokens, text, kept):
    """Answers are kept for resends within worker.answered_cache answers and that many times 16 KiB, the oldest going
    first: 10,000 answers of 1,200 tokens took 519 MB of a worker where the code meant ~200 MB; now 158 MB."""
    intake, emitted = _intake(Settings.model_validate({"worker": {"answered_cache": 1_000}}))
    for i in range(3_000):
        intake.answer(("acme", f"r{i}"), Outcome(TP, i, result=_answer(i, tokens, text), usage=object(), epoch=1))
    assert len(emitted) == 3_000 and len(intake.answers) == kept
    assert list(intake.answers) == [("acme", f"r{i}") for i in range(3_000 - kept, 3_000)]  # the newest
    assert intake.answers_bytes == sum(answer_bytes(r) for r in intake.answers.values()) <= 1_000 * ANSWER_BYTES


class _BaseRouter:
    """Routes every job to the base model."""

    async def route_batch(self, snapshot, classifier, jobs):
        from consumer.routing import Route

        return [Route(None, "base_model", 5) for _ in jobs]


@pytest.mark.parametrize("big", [
    {"max_new_tokens": 131_072},  # the contract's bound: the engine (engine.max_new_tokens=256) refuses it
    {"prompt": "x" * 900_000},  # ~300,000 tokens by the estimate: over engine.max_prompt_tokens=1024
])
def test_a_job_over_the_engines_limits_does_not_spend_its_tenants_quota_for_minutes(big):
    """A job the engine must refuse (it runs no token) was charged to its tenant's token bucket at its own word:
    max_new_tokens=131072 took 131,073 tokens of a 10,000-per-minute bucket, and the tenant's next small job asking
    on_quota="fail" failed with quota_exceeded for the next 12 minutes (a "wait" one waited as long). A job's tokens, for
    quotas, batches and fair shares, count no more than the engine can run for one request."""
    from consumer.tenants import TenantView

    clock = Clock()
    settings = Settings()
    scheduler = Scheduler(8, 8192, 4, clock=clock)
    from consumer.scheduler import TenantPolicy

    scheduler.set_policy("acme", TenantPolicy(1, 0, 10_000))
    tenant = TenantView("acme", "Acme", "standard", 1, 0, 10_000)
    intake = Intake(settings, WorkerMetrics(), "w1", scheduler, _BaseRouter(), None, None, asyncio.Event(),
                    SimpleNamespace(rules=[], tenants={"acme": tenant}))
    emitted: list = []
    intake.deliverer = SimpleNamespace(emit=emitted.append)
    first = parse_job(json.dumps({"request_id": "big", "tenant_id": "acme", "prompt": "hi", **big}).encode())
    asyncio.run(intake.admit([(TP, 0, 1, first)], datetime.now(UTC)))
    (p,) = scheduler.pop_batch()
    limits = settings.engine
    assert p.tokens <= limits.max_prompt_tokens + limits.max_new_tokens, p.tokens
    clock.t += 1.0
    small = parse_job(_job("small", "hello").replace(b'"max_new_tokens": 4', b'"max_new_tokens": 4, "on_quota": "fail"'))
    asyncio.run(intake.admit([(TP, 1, 1, small)], datetime.now(UTC)))
    assert not emitted, emitted[0].result.error
    assert [q.payload.job.request_id for q in scheduler.pop_batch()] == ["small"]
