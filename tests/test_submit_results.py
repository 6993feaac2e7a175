"""`lorabatch submit` and `lorabatch results` against the embedded broker (real Kafka protocol).

Submit checks every message against kafka.max_message_bytes before it produces anything; results are a
tenant's: two tenants that use the same batch id and request ids never see each other's results.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid

import pytest
from aiokafka.errors import MessageSizeTooLargeError
from typer.testing import CliRunner

from consumer.broker import ensure_topics
from consumer.cli import build_app
from consumer.config import Settings, load_settings
from consumer.kafka import make_producer, record_size
from consumer.schemas import BatchManifest, DlqRecord, ErrorInfo, Job, Result
from consumer.submit import SubmitError, collect_results, produce_jobs, read_manifest
from tests.service_fixtures import read_all

app = build_app()
runner = CliRunner()


def _settings(broker, **extra) -> tuple[Settings, dict]:
    run = uuid.uuid4().hex[:8]
    overrides = {
        "kafka.bootstrap_servers": broker.bootstrap,
        "kafka.jobs_topic": f"{run}.jobs",
        "kafka.results_topic": f"{run}.results",
        "kafka.dlq_topic": f"{run}.dlq",
        "kafka.batches_topic": f"{run}.batches",
        "kafka.partitions": 2,
        **extra,
    }
    s = load_settings(None, overrides)
    k = s.kafka
    asyncio.run(ensure_topics(k.bootstrap_servers, [k.jobs_topic, k.results_topic, k.dlq_topic, k.batches_topic], k.partitions))
    return s, overrides


def _config_file(tmp_path, overrides: dict) -> str:
    """The overrides' kafka keys as a TOML file for the CLI, with a ledger that is not there (`results` reads the
    ledger where two copies of a result differ; the default .lorabatch/ledger.db could be a demo's)."""
    lines = [f"[ledger]\nurl = {json.dumps(f'sqlite:///{tmp_path}/no-ledger/ledger.db')}", "[kafka]"]
    lines += [f"{key.split('.', 1)[1]} = {json.dumps(value)}" for key, value in overrides.items()]
    path = tmp_path / "lorabatch.toml"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _job(tenant: str, rid: str, prompt: str = "hi", batch: str = "b1") -> Job:
    return Job.model_validate({"tenant_id": tenant, "request_id": rid, "batch_id": batch, "prompt": prompt})


async def _produce(s: Settings, topic: str, values: list[bytes], key: bytes | None = None) -> None:
    producer = make_producer(s.kafka)
    await producer.start()
    try:
        for value in values:
            await producer.send_and_wait(topic, value, key=key)
    finally:
        await producer.stop()


# ---- the message limit ---------------------------------------------------------------------------------


def test_producer_limit_is_the_configured_limit(broker):
    """The producer takes a record of exactly kafka.max_message_bytes (as record_size counts it) and refuses one byte more."""
    s, _ = _settings(broker, **{"kafka.max_message_bytes": 2048})
    key = b"acme"

    async def send(size: int) -> None:
        value = b"x" * (size - record_size(key, b"x" * 1000) + 1000)  # the length's varint as long as at `size`
        assert record_size(key, value) == size
        await _produce(s, s.kafka.jobs_topic, [value], key=key)

    asyncio.run(send(2048))
    with pytest.raises(MessageSizeTooLargeError):
        asyncio.run(send(2049))


def test_produce_jobs_refuses_a_batch_with_an_oversized_job(broker):
    """One job over the limit and nothing is produced: no job, no manifest; the error names it, its size and the limit."""
    s, _ = _settings(broker, **{"kafka.max_message_bytes": 2048})
    jobs = [_job("acme", "small"), _job("acme", "big", "x" * 3000)]
    with pytest.raises(SubmitError, match=r"1 of 2 jobs are over kafka.max_message_bytes=2048.*'big' \(\d+ bytes\); nothing was produced"):
        asyncio.run(produce_jobs(s.kafka, jobs, "b1", "acme", "test", "tenant"))
    assert asyncio.run(read_all(s, s.kafka.jobs_topic, Job, lambda got: False, timeout_s=1.5)) == []
    assert asyncio.run(read_all(s, s.kafka.batches_topic, BatchManifest, lambda got: False, timeout_s=1.5)) == []


def test_cli_submit_rejects_the_oversized_line(broker, tmp_path):
    """`submit` names the line over kafka.max_message_bytes with its size and the limit, sends the rest, and exits 1."""
    s, overrides = _settings(broker, **{"kafka.max_message_bytes": 2048})
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(json.dumps({"prompt": p}) for p in ("a", "x" * 3000, "c")) + "\n")
    out = runner.invoke(app, ["submit", str(jobs), "--tenant", "acme", "--batch-id", "b1", "--config", _config_file(tmp_path, overrides)])
    assert out.exit_code == 1, out.output
    said = " ".join(out.output.split())  # the console wraps long lines
    assert "line 2: the job is " in said and "bytes as a Kafka message, over kafka.max_message_bytes=2048" in said
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"batch_id": "b1", "submitted": 2, "rejected": 1}
    sent = asyncio.run(read_all(s, s.kafka.jobs_topic, Job, lambda got: len(got) >= 2, timeout_s=20))
    assert sorted(j.request_id for j in sent) == ["b1-1", "b1-3"]
    assert asyncio.run(read_manifest(s.kafka, "acme", "b1")).request_ids == ["b1-1", "b1-3"]


def test_a_large_manifest_goes_in_parts(broker):
    """A batch whose manifest passes the limit is written as several manifests, read back as one with every id in order."""
    s, _ = _settings(broker, **{"kafka.max_message_bytes": 1024})
    jobs = [_job("acme", f"request-{i:04d}") for i in range(300)]
    asyncio.run(produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request"))
    parts = asyncio.run(read_all(s, s.kafka.batches_topic, BatchManifest, lambda got: False, timeout_s=2))
    assert len(parts) > 1
    assert asyncio.run(read_manifest(s.kafka, "acme", "b1")).request_ids == [j.request_id for j in jobs]


# ---- results are a tenant's ----------------------------------------------------------------------------


def _result(tenant: str, rid: str, text: str, batch: str | None = "b1", worker: str = "w0") -> bytes:
    return Result(request_id=rid, tenant_id=tenant, batch_id=batch, status="succeeded", text=text, worker_id=worker).model_dump_json().encode()


def _dlq(tenant: str, rid: str, batch: str = "b1") -> bytes:
    return DlqRecord(error=ErrorInfo(code="message_too_large", message="too large"), source_topic="jobs", source_partition=0,
                     source_offset=7, raw="", raw_b64="", request_id=rid, tenant_id=tenant, batch_id=batch).model_dump_json().encode()


@pytest.fixture
def two_tenants(broker):
    """acme and globex both submitted batch b1 with request ids r1 and r2 (globex also r3, dead-lettered)."""
    s, overrides = _settings(broker)
    k = s.kafka

    async def write() -> None:
        for tenant, ids in (("acme", ["r1", "r2"]), ("globex", ["r1", "r2", "r3"])):
            manifest = BatchManifest(batch_id="b1", tenant_id=tenant, request_ids=ids)
            await _produce(s, k.batches_topic, [manifest.model_dump_json().encode()], key=b"b1")
        await _produce(s, k.results_topic, [
            _result("globex", "r1", "globex one"),
            _result("acme", "r1", "acme one"),
            _result("globex", "r2", "globex two"),
            _result("acme", "r2", "acme two"),
            _result("acme", "r2", "acme two"),  # a replay: the same body again (a second run's differs: test_results_billed)
            _result("acme", "r9", "not in the batch"),
        ], key=None)
        await _produce(s, k.dlq_topic, [_dlq("globex", "r3"), _dlq("acme", "r3")])

    asyncio.run(write())
    return s, overrides


def test_manifests_are_found_by_tenant_and_batch(two_tenants):
    """The same batch id of two tenants is two batches; a tenant that submitted none has none."""
    s, _ = two_tenants
    assert asyncio.run(read_manifest(s.kafka, "acme", "b1")).request_ids == ["r1", "r2"]
    assert asyncio.run(read_manifest(s.kafka, "globex", "b1")).request_ids == ["r1", "r2", "r3"]
    assert asyncio.run(read_manifest(s.kafka, "initech", "b1")) is None


def test_results_count_only_the_manifests_tenant(two_tenants):
    """Each tenant collects its own results and DLQ records by request id, a replayed result once."""
    s, _ = two_tenants
    for tenant, texts, dead in (("acme", {"r1": "acme one", "r2": "acme two"}, {}),
                                ("globex", {"r1": "globex one", "r2": "globex two"}, {"r3"})):
        manifest = asyncio.run(read_manifest(s.kafka, tenant, "b1"))
        ticks: list[int] = []
        got, dlq = asyncio.run(collect_results(s.kafka, manifest, 20, progress=ticks.append))
        assert {rid: r.text for rid, r in got.items()} == texts
        assert {r.tenant_id for r in got.values()} == {tenant}
        assert {rid: d.tenant_id for rid, d in dlq.items()} == {rid: tenant for rid in dead}
        assert sum(ticks) == len(manifest.request_ids)  # the replay is not counted twice


def test_a_resubmitted_request_is_answered_by_its_first_result(broker):
    """A request id of the tenant resubmitted in a new batch takes the result published for it before, whatever its batch id."""
    s, _ = _settings(broker)

    async def write() -> None:
        manifest = BatchManifest(batch_id="b2", tenant_id="acme", request_ids=["r1"])
        await _produce(s, s.kafka.batches_topic, [manifest.model_dump_json().encode()], key=b"b2")
        await _produce(s, s.kafka.results_topic, [_result("acme", "r1", "from b1", batch="b1")])
        await _produce(s, s.kafka.dlq_topic, [_dlq("acme", "r1", batch="b1")])  # a dead-lettered message of b1 is not b2's

    asyncio.run(write())
    got, dlq = asyncio.run(collect_results(s.kafka, asyncio.run(read_manifest(s.kafka, "acme", "b2")), 20))
    assert {rid: r.text for rid, r in got.items()} == {"r1": "from b1"} and dlq == {}


def test_cli_results_takes_the_tenant(two_tenants, tmp_path):
    """`results --tenant T --batch-id B` writes T's results in submission order; --tenant is required; another tenant's batch id is not found."""
    s, overrides = two_tenants
    config = _config_file(tmp_path, overrides)
    out = runner.invoke(app, ["results", "--tenant", "globex", "--batch-id", "b1", "--timeout", "20", "--config", config])
    assert out.exit_code == 0, out.output
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [(r["request_id"], r["status"], r.get("text")) for r in lines] == [
        ("r1", "succeeded", "globex one"), ("r2", "succeeded", "globex two"), ("r3", "dlq", None)]
    missing = runner.invoke(app, ["results", "--batch-id", "b1", "--config", config])
    assert missing.exit_code == 2 and "--tenant" in missing.output
    other = runner.invoke(app, ["results", "--tenant", "initech", "--batch-id", "b1", "--config", config])
    assert other.exit_code == 2 and "no batch 'b1' of tenant 'initech'" in other.output


def test_cli_says_when_the_broker_is_down(tmp_path):
    """With no broker, submit and results exit 2 naming the servers; submit says which --batch-id to submit again with."""
    from consumer.broker import free_port

    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "a"}\n')
    out = runner.invoke(app, ["submit", str(jobs), "--tenant", "acme", "--batch-id", "b7", "--config", config])
    said = " ".join(out.output.split())
    assert out.exit_code == 2 and "failed" in said and "submit again with --batch-id b7" in said, out.output
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b7", "--config", config])
    assert out.exit_code == 2 and "lorabatch broker start" in " ".join(out.output.split()), out.output


def test_foreign_records_on_the_results_topics_are_skipped(broker):
    """Someone else's message on the results, DLQ or batches topic (not JSON, or not our record) is skipped:
    collecting a batch still finds its results."""
    s, _ = _settings(broker)
    k = s.kafka
    manifest = BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1"])
    ok = Result(request_id="r1", tenant_id="acme", batch_id="b1", status="succeeded", text="hi")

    async def scenario():
        for topic in (k.results_topic, k.dlq_topic, k.batches_topic):
            await _produce(s, topic, [b"{not json", b'{"unrelated": true}'], key=b"b1")
        await _produce(s, k.batches_topic, [manifest.model_dump_json().encode()], key=b"b1")
        await _produce(s, k.results_topic, [ok.model_dump_json().encode()], key=b"r1")
        found = await read_manifest(k, "acme", "b1", timeout_s=10)
        assert found is not None and found.request_ids == ["r1"]
        return await collect_results(k, found, timeout_s=10)

    results, dlq = asyncio.run(scenario())
    assert list(results) == ["r1"] and results["r1"].text == "hi" and dlq == {}


def test_a_manifest_is_read_whole_however_short_the_timeout(broker):
    """What the batches topic holds is read to its end: cut at the timeout, a manifest behind other batches' parts came
    back with part of its ids (430,000 of a million) and `results` wrote that part as the whole batch."""
    s, _ = _settings(broker, **{"kafka.max_message_bytes": 1024})
    others = [_job("acme", f"o-{i:04d}", batch="other") for i in range(600)]
    asyncio.run(produce_jobs(s.kafka, others, "other", "acme", "test", "request"))
    jobs = [_job("acme", f"request-{i:04d}") for i in range(300)]
    asyncio.run(produce_jobs(s.kafka, jobs, "b1", "acme", "test", "request"))
    found = asyncio.run(read_manifest(s.kafka, "acme", "b1", timeout_s=0))
    assert found is not None and found.request_ids == [j.request_id for j in jobs]


def test_cli_results_output_checked_beforehand_leaves_no_trace(two_tenants, tmp_path):
    """Trying -o before the wait creates nothing that was not there: a batch not found leaves no empty file, and a link
    to a file yet to be written stays a link (the file is written through it)."""
    _, overrides = two_tenants
    config = _config_file(tmp_path, overrides)
    absent = tmp_path / "absent.jsonl"
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "nope", "-o", str(absent), "--config", config])
    assert out.exit_code == 2 and not absent.exists()
    link = tmp_path / "link.jsonl"
    link.symlink_to(tmp_path / "target.jsonl")
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", "20", "-o", str(link), "--config", config])
    assert out.exit_code == 0 and link.is_symlink() and len((tmp_path / "target.jsonl").read_text().splitlines()) == 2


def test_cli_results_timeout_zero_takes_what_is_there(two_tenants, tmp_path):
    """--timeout 0 writes the results already published (it read nothing and said every job had none)."""
    _, overrides = two_tenants
    target = tmp_path / "out.jsonl"
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", "0", "-o", str(target),
                              "--config", _config_file(tmp_path, overrides)])
    assert out.exit_code == 0, out.output
    assert [json.loads(line)["text"] for line in target.read_text().splitlines()] == ["acme one", "acme two"]


# ---- a file read as it is produced, and what submit and results say when cut short ---------------------


def test_a_file_is_produced_in_chunks_each_named_by_its_manifest(broker, tmp_path, monkeypatch):
    """produce_lines produces a chunk of jobs, then the manifest parts naming them, before it reads on: a submission cut
    short (here the file could not be read past line 5) leaves the chunks produced, each named by the batch's manifest."""
    from consumer import submit
    from consumer.batch_file import SubmitError, read_lines

    s, _ = _settings(broker)
    monkeypatch.setattr(submit, "MANIFEST_EVERY", 2)
    p = tmp_path / "jobs.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(1, 8)))

    def cut(lines):
        for line in lines:
            if line.number == 6:
                raise SubmitError("cannot read jobs.jsonl after line 5")
            yield line

    told: list[int] = []
    with pytest.raises(SubmitError):
        asyncio.run(submit.produce_lines(s.kafka, cut(read_lines(p, "acme", "b1", max_message_bytes=s.kafka.max_message_bytes)),
                                         "b1", "acme", str(p), "tenant", sent=told.append))
    assert told == [2, 4]
    cut_short = asyncio.run(read_manifest(s.kafka, "acme", "b1"))
    assert cut_short.request_ids == ["b1-1", "b1-2", "b1-3", "b1-4"] and cut_short.complete is False
    parts = asyncio.run(read_all(s, s.kafka.batches_topic, BatchManifest, lambda got: len(got) >= 3, timeout_s=20))
    assert len({m.created_at for m in parts}) == 1  # one batch: `created` of its OpenAI answers is the same for all
    # the same file again under the same batch id adds the rest and closes the batch
    asyncio.run(submit.produce_lines(s.kafka, read_lines(p, "acme", "b1"), "b1", "acme", str(p), "tenant"))
    whole = asyncio.run(read_manifest(s.kafka, "acme", "b1"))
    assert whole.request_ids == [f"b1-{n}" for n in range(1, 8)] and whole.complete is True


def test_cli_results_of_a_submission_not_finished_say_so(two_tenants, tmp_path):
    """A batch whose last submission is still open (submit still producing it, or cut short) is collected for the jobs
    produced so far and said to be unfinished (exit 1): with its manifest written a chunk at a time, `results` run
    beside a `submit` wrote the first chunks' results as the whole batch and exited 0."""
    s, overrides = two_tenants
    opened = BatchManifest(batch_id="b1", tenant_id="acme", request_ids=[], complete=False)
    asyncio.run(_produce(s, s.kafka.batches_topic, [opened.model_dump_json().encode()], key=b"b1"))
    target = tmp_path / "out.jsonl"
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--timeout", "20", "-o", str(target),
                              "--config", _config_file(tmp_path, overrides)])
    said = " ".join(out.output.split())
    assert out.exit_code == 1 and "the file holds the results of the 2 jobs produced so far" in said, out.output
    assert "the batch's submission has not finished" in said and "--batch-id b1" in said
    assert [json.loads(line)["text"] for line in target.read_text().splitlines()] == ["acme one", "acme two"]


def test_a_chunk_is_bounded_by_the_bytes_of_its_lines(broker, tmp_path, monkeypatch):
    """A chunk ends at CHUNK_BYTES of lines as well as at MANIFEST_EVERY jobs: 5,000 lines of 1 MB prompts were held
    at once (10 GB with their records). Under adapter-balanced the file is one chunk."""
    from consumer import submit
    from consumer.batch_file import read_lines

    s, _ = _settings(broker)
    monkeypatch.setattr(submit, "CHUNK_BYTES", 250)
    p = tmp_path / "jobs.jsonl"
    p.write_text("".join(json.dumps({"prompt": "x" * 90}) + "\n" for _ in range(5)))  # 106 bytes a line
    for key_by, batch, chunks in (("tenant", "b1", [3, 5]), ("adapter-balanced", "b2", [5])):
        told: list[int] = []
        asyncio.run(submit.produce_lines(s.kafka, read_lines(p, "acme", batch), batch, "acme", str(p), key_by, sent=told.append))
        assert told == chunks, key_by
        assert asyncio.run(read_manifest(s.kafka, "acme", batch)).request_ids == [f"{batch}-{n}" for n in range(1, 6)]


def test_cli_submit_refuses_an_empty_file_and_a_bad_key(tmp_path):
    """A file with no line but blank ones is an error (exit 2; it said submitted 0 and exited 0, and `results` then found
    no batch); --key takes one of its four values, named as the option (it was named as lorabatch.toml's key)."""
    from consumer.broker import free_port

    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})  # never reached
    for text in ("", "\n  \r\n\t\n"):
        jobs = tmp_path / "jobs.jsonl"
        jobs.write_text(text)
        out = runner.invoke(app, ["submit", str(jobs), "--tenant", "acme", "--config", config])
        said = " ".join(out.output.split())
        assert out.exit_code == 2 and "holds no job: it is empty, or its lines are blank" in said, out.output
    out = runner.invoke(app, ["submit", str(jobs), "--tenant", "acme", "--key", "partition", "--config", config])
    assert out.exit_code == 2 and "--key 'partition': use tenant, adapter, adapter-balanced, request" in " ".join(out.output.split())


def test_cli_submit_interrupted_names_the_batch_to_submit_again(tmp_path, monkeypatch):
    """^C in the middle of a submission says the batch id to submit the file again under (one it made is printed
    nowhere else: submitted afresh, the jobs already produced ran and were billed twice) and exits 130."""
    from consumer import submit
    from consumer.broker import free_port

    async def interrupted(cfg, lines, batch_id, tenant_id, source, key_by, sent=None):
        for _ in lines:
            pass
        sent(5000)
        raise KeyboardInterrupt

    monkeypatch.setattr(submit, "produce_lines", interrupted)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text('{"prompt": "a"}\n')
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    out = runner.invoke(app, ["submit", str(jobs), "--tenant", "acme", "--config", config])
    said = " ".join(out.output.split())
    bid = re.search(r"batch (batch_[0-9a-f]{16}) produced", said)
    assert out.exit_code == 130 and bid and f"submit the file again with --batch-id {bid.group(1)}" in said, out.output


@pytest.mark.parametrize(("args", "says"), [
    (["-o", "{tmp}/no/such/folder/out.jsonl"], "cannot write -o {tmp}/no/such/folder/out.jsonl: No such file or directory"),
    (["-o", "{tmp}"], "cannot write -o {tmp}: it is a directory; give a file path"),
    (["--timeout", "nan"], "--timeout nan: give the seconds to wait for the batch, 0 or more"),
    (["--timeout", "-5"], "--timeout -5.0: give the seconds to wait for the batch, 0 or more"),
])
def test_cli_results_checks_its_options_before_it_waits(tmp_path, args, says):
    """An output file that cannot be written, or a timeout that is no time, ends the command at once (exit 2), where it
    was found after the whole wait (up to --timeout, 600 s by default) or read as 'no result after nans'."""
    from consumer.broker import free_port

    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})  # never reached
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "--config", config, *args])
    assert out.exit_code == 2 and says.replace("{tmp}", str(tmp_path)) in " ".join(out.output.split()), out.output


def test_cli_results_interrupted_says_nothing_is_lost(tmp_path, monkeypatch):
    """^C while waiting says how many results were in and that the same command collects them again (exit 130)."""
    from consumer import submit
    from consumer.broker import free_port

    async def manifest(*args, **kwargs):
        return BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1", "r2"])

    async def interrupted(cfg, manifest, timeout_s, progress=None, contested=None):
        progress(1)
        raise KeyboardInterrupt

    monkeypatch.setattr(submit, "read_manifest", manifest)
    monkeypatch.setattr(submit, "collect_results", interrupted)
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "-o", str(tmp_path / "out.jsonl"), "--config", config])
    said = " ".join(out.output.split())
    assert out.exit_code == 130 and "interrupted with 1 of 2 results collected; nothing was written" in said, out.output
    assert "run the same command again to collect them" in said and not (tmp_path / "out.jsonl").exists()
