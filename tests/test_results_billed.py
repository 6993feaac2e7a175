"""`lorabatch results` writes the copy of each result the ledger billed.

One request id of a tenant on two jobs partitions is run by two workers at once: each publishes its own result (both
on one results partition, keyed by request id), and the ledger's unique key bills the row written first. The first
copy *published* is not always that one; `results` kept it, and so wrote a `cost`, `worker_id` (and, sampled without
a seed, a `text`) that the invoice and a later resend disagreed with. Through the real broker and a real ledger.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from datetime import UTC, datetime

import pytest
from aiokafka import TopicPartition
from typer.testing import CliRunner

from billing.db import make_engine
from billing.ledger import Ledger
from billing.records import UsageRecord
from consumer.broker import ensure_topics
from consumer.cli import build_app
from consumer.config import load_settings
from consumer.delivery import Deliverer, Outcome
from consumer.kafka import make_producer
from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker
from consumer.schemas import Cost, Result
from consumer.spool import Spool

app = build_app()
runner = CliRunner()
NOW = datetime.now(UTC)


def _settings(broker, ledger_url: str):
    run = uuid.uuid4().hex[:8]
    overrides = {"kafka.bootstrap_servers": broker.bootstrap, "kafka.jobs_topic": f"{run}.jobs",
                 "kafka.results_topic": f"{run}.results", "kafka.dlq_topic": f"{run}.dlq",
                 "kafka.batches_topic": f"{run}.batches", "kafka.partitions": 2, "ledger.url": ledger_url}
    s = load_settings(None, overrides)
    k = s.kafka
    asyncio.run(ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions))
    return s, overrides


def _config(tmp_path, overrides: dict) -> str:
    sections: dict[str, list[str]] = {}
    for key, value in overrides.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, []).append(f"{name} = {json.dumps(value)}")
    path = tmp_path / f"lorabatch-{uuid.uuid4().hex[:6]}.toml"
    path.write_text("".join(f"[{name}]\n" + "\n".join(lines) + "\n" for name, lines in sections.items()))
    return str(path)


def _job(rid: str) -> bytes:
    return json.dumps({"tenant_id": "acme", "batch_id": "b1", "request_id": rid, "prompt": "hi", "temperature": 1.0}).encode()


async def _produce(s, topic: str, values: list[bytes], key: bytes) -> None:
    producer = make_producer(s.kafka)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


def _run(worker: str, text: str, base_ms: float, rid: str = "r1") -> Outcome:
    """One worker's run of acme's `rid`: its own sampled text, cost and worker id."""
    result = Result(request_id=rid, tenant_id="acme", batch_id="b1", status="succeeded", text=text, finish_reason="length",
                    cost=Cost(base_ms=base_ms), worker_id=worker)
    usage = UsageRecord(tenant_id="acme", request_id=rid, status="succeeded", created_at=NOW, batch_id="b1",
                        base_us=int(base_ms * 1000), output_tokens=2, worker_id=worker)
    return Outcome(TopicPartition("jobs", 0 if worker == "w1" else 1), 0, result=result, usage=usage, epoch=1)


class HeldLedger:
    """The real ledger, whose usage writes wait until `go` is set: a worker whose ledger write lags its publish."""

    def __init__(self, ledger: Ledger):
        self.ledger = ledger
        self.go = threading.Event()

    def record_usage(self, records):
        assert self.go.wait(30)
        return self.ledger.record_usage(records)


def _race(s, tmp_path, first_published: Outcome, first_billed: Outcome) -> Ledger:
    """`first_published`'s worker publishes, then lags; `first_billed`'s worker publishes and bills; then the first
    worker's ledger insert finds the other's row (kept as redelivered work, not billed)."""
    ledger = Ledger(make_engine(s.ledger.url), s.ledger)

    async def race() -> None:
        producer = make_producer(s.kafka)
        await producer.start()
        held = HeldLedger(ledger)
        try:
            workers = []
            for name, sink in (("slow", held), ("fast", ledger)):
                offsets = OffsetTracker()
                offsets.fetched(TopicPartition("jobs", 0 if name == "slow" else 1), 0)
                workers.append(Deliverer(s.kafka, producer, sink, offsets, WorkerMetrics(), name, lambda t: True,
                                         Spool(tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.sqlite", max_records=100)))
            slow = asyncio.create_task(workers[0].deliver([first_published]))
            while "result" not in first_published.sent:
                await asyncio.sleep(0.01)
            await workers[1].deliver([first_billed])
            held.go.set()
            await slow
        finally:
            await producer.stop()

    asyncio.run(race())
    return ledger


@pytest.fixture
def raced(broker, tmp_path, ledger_url):
    """acme's batch b1 of one job r1, run by w2 and w1 at once: w2's copy published first, w1's billed."""
    s, overrides = _settings(broker, ledger_url)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1")], key=b"acme"))
    ledger = _race(s, tmp_path, first_published=_run("w2", "sampled by w2", 9.0), first_billed=_run("w1", "sampled by w1", 4.0))
    yield s, overrides, ledger


def test_results_writes_the_copy_the_ledger_billed_not_the_first_published(raced, tmp_path):
    """Two copies of one request on the results topic, w2's first, the ledger billing w1's: `results` wrote w2's
    text, cost and worker id, which neither the invoice nor a resend (answered from the ledger's row) agreed with."""
    s, overrides, ledger = raced
    row = ledger.usage_for("acme", "r1")
    assert row.worker_id == "w1"  # the race as set: billed by w1, published first by w2
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", "20",
                              "--config", _config(tmp_path, overrides)])
    assert out.exit_code == 0, out.output
    [line] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert (line["text"], line["worker_id"], line["cost"]["base_ms"]) == ("sampled by w1", "w1", 4.0)
    assert line == json.loads(row.result_json)  # byte for byte the body the ledger keeps and a resend replays


def test_the_first_published_copy_billed_is_written_with_no_note(broker, tmp_path, ledger_url):
    """The other order of the same race: the first copy published is the billed one; it is written, and nothing is
    said (a note is for a copy swapped)."""
    s, overrides = _settings(broker, ledger_url)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1")], key=b"acme"))
    _race(s, tmp_path, first_published=_run("w1", "sampled by w1", 4.0), first_billed=_run("w2", "sampled by w2", 9.0))
    # w1 published first, but w2 wrote its row first: the ledger bills w2, so w2's copy is the one written.
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", "20",
                              "--config", _config(tmp_path, overrides)])
    assert out.exit_code == 0, out.output
    [line] = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    assert line["worker_id"] == "w2" and "ledger billed" in " ".join(out.stderr.split())


# ---- the ledger: away, late, or holding what is not a result ------------------------------------------------------


def _copies(s, rid: str, *runs: tuple[str, str]) -> list[Result]:
    """Results of acme's `rid` by (worker, text), published in that order on the results topic."""
    results = [Result(request_id=rid, tenant_id="acme", batch_id="b1", status="succeeded", text=text, worker_id=worker)
               for worker, text in runs]
    asyncio.run(_produce(s, s.kafka.results_topic, [r.model_dump_json().encode() for r in results], key=rid.encode()))
    return results


def _bill(ledger: Ledger, rid: str, worker: str, body: str | None) -> None:
    ledger.record_usage([UsageRecord(tenant_id="acme", request_id=rid, status="succeeded", created_at=NOW, batch_id="b1",
                                     base_us=1000, worker_id=worker, result_json=body)])


def _results(tmp_path, overrides: dict, timeout: str = "20"):
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", timeout,
                              "--config", _config(tmp_path, overrides)])
    return out, [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("where", ["sqlite_missing", "postgres_down"])
def test_an_unreachable_ledger_with_two_copies_writes_the_first_and_says_why(broker, tmp_path, where):
    """Two different copies and a ledger `results` cannot read (no such SQLite file; a PostgreSQL port nobody
    listens on): the file holds the first copy, and status 1 says how many could not be told, why, and the fix. A
    missing SQLite file is not made (`results` runs where no ledger is)."""
    from consumer.broker import free_port

    url = (f"sqlite:///{tmp_path}/absent/ledger.db" if where == "sqlite_missing"
           else f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/nothing")
    s, overrides = _settings(broker, url)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1"), _job("r2")], key=b"acme"))
    _copies(s, "r1", ("w2", "two"), ("w1", "one"))
    _copies(s, "r2", ("w1", "alone"), ("w1", "alone"))  # the same body replayed: no second run, nothing to tell
    out, lines = _results(tmp_path, overrides)
    said = " ".join(out.stderr.split())
    assert out.exit_code == 1, out.output
    assert [(x["request_id"], x["text"]) for x in lines] == [("r1", "two"), ("r2", "alone")]
    assert "1 requests (e.g. 'r1') have two different results" in said and "make ledger.url reachable" in said, said
    assert not (tmp_path / "absent").exists()


def test_one_copy_and_no_ledger_is_written_as_before(broker, tmp_path):
    """No request with two copies: a ledger that cannot be read changes nothing (status 0, no line): `results` on a
    host without the ledger works as it did."""
    s, overrides = _settings(broker, f"sqlite:///{tmp_path}/none/ledger.db")
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1")], key=b"acme"))
    _copies(s, "r1", ("w1", "one"))
    out, lines = _results(tmp_path, overrides)
    assert out.exit_code == 0 and "ledger" not in out.stderr and "error" not in out.stderr, out.output
    assert [x["text"] for x in lines] == ["one"]


def test_a_row_written_after_the_copies_are_read_is_waited_for(broker, tmp_path, ledger_url):
    """Both copies published, neither row written yet (each worker bills just after it publishes): `results` waits
    for the row (up to 10 s) rather than write the first copy."""
    s, overrides = _settings(broker, ledger_url)
    ledger = Ledger(make_engine(s.ledger.url), s.ledger)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1")], key=b"acme"))
    _, late = _copies(s, "r1", ("w2", "two"), ("w1", "one"))
    timer = threading.Timer(1.5, _bill, (ledger, "r1", "w1", late.model_dump_json()))
    timer.start()
    started = time.monotonic()
    out, lines = _results(tmp_path, overrides)
    timer.join()
    assert out.exit_code == 0, out.output
    assert [x["text"] for x in lines] == ["one"] and time.monotonic() - started < 15


def test_a_row_that_never_comes_is_waited_for_no_longer_than_the_timeout(broker, tmp_path, ledger_url):
    """Two copies and no row (the billing worker's ledger was away: its row waits in its spool): `results` waits at
    most --timeout (here 1 s; 10 s by default) for it, writes the first copy and says so with status 1."""
    s, overrides = _settings(broker, ledger_url)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1")], key=b"acme"))
    _copies(s, "r1", ("w2", "two"), ("w1", "one"))
    started = time.monotonic()
    out, lines = _results(tmp_path, overrides, timeout="1")
    assert time.monotonic() - started < 8
    assert out.exit_code == 1 and [x["text"] for x in lines] == ["two"]
    assert "no ledger row within 1 s" in " ".join(out.stderr.split()), out.output


@pytest.mark.parametrize("body", [None, "", "not json", '{"request_id": "r9", "tenant_id": "acme", "status": "succeeded"}',
                                  '{"request_id": "r1", "tenant_id": "globex", "status": "succeeded"}', "[" * 50_000])
def test_a_row_whose_body_is_not_this_requests_result_is_not_written(broker, tmp_path, ledger_url, body):
    """A row without a body (written before the ledger kept them), with one that does not parse, or with another
    request's or tenant's result: never written as this request's answer; with two copies, the request is unsettled."""
    s, overrides = _settings(broker, ledger_url)
    ledger = Ledger(make_engine(s.ledger.url), s.ledger)
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job("r1"), _job("r2")], key=b"acme"))
    _copies(s, "r1", ("w2", "two"), ("w1", "one"))
    _copies(s, "r2", ("w1", "only"))
    _bill(ledger, "r1", "w1", body)
    _bill(ledger, "r2", "w1", body)
    out, lines = _results(tmp_path, overrides, timeout="1")
    assert [(x["request_id"], x["text"]) for x in lines] == [("r1", "two"), ("r2", "only")]
    assert out.exit_code == 1 and "1 requests (e.g. 'r1')" in " ".join(out.stderr.split()), out.output


def test_a_lone_copy_of_a_run_not_billed_is_swapped_for_the_billed_one(broker, tmp_path, ledger_url, monkeypatch):
    """The topic read holds only the run not billed (the billed one published after `results` read it, or on
    another cluster's topic): the ledger's body is what was billed and what a resend replays, so it is written.
    Read in chunks (here of 2 keys) over many requests, each row is matched to its own request."""
    import consumer.billed

    monkeypatch.setattr(consumer.billed, "_CHUNK", 2)
    s, overrides = _settings(broker, ledger_url)
    ledger = Ledger(make_engine(s.ledger.url), s.ledger)
    rids = [f"r{i}" for i in range(7)]
    asyncio.run(_produce(s, s.kafka.jobs_topic, [_job(rid) for rid in rids], key=b"acme"))
    for rid in rids:
        _copies(s, rid, ("w2", f"{rid} by w2"))
        billed = Result(request_id=rid, tenant_id="acme", batch_id="b1", status="succeeded", text=f"{rid} by w1", worker_id="w1")
        _bill(ledger, rid, "w1" if rid != "r3" else "w2", billed.model_dump_json() if rid != "r3" else None)
    out, lines = _results(tmp_path, overrides)
    assert out.exit_code == 0, out.output
    assert [x["text"] for x in lines] == [f"{rid} by w1" if rid != "r3" else "r3 by w2" for rid in rids]
    assert "6 results written as the ledger billed them" in " ".join(out.stderr.split())
