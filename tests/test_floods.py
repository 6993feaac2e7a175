"""Floods a producer can send a worker that runs for weeks: bad messages by the thousand must not grow the worker's log
with the traffic."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from consumer.config import Settings
from consumer.intake import Intake
from consumer.logs import Repeats
from consumer.metrics import WorkerMetrics

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
