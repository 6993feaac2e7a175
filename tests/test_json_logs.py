"""The worker's log is JSON lines: every line one object with ts, level, logger and msg (consumer.logs), whatever
the message holds, tracebacks included as a string field."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from consumer.logs import JsonFormatter, LibraryRepeats, json_logging
from consumer.schemas import Job, Result
from consumer.submit import produce_jobs
from tests.service_fixtures import open_services, produce_raw, read_all, service_settings


def _record(msg, *args, exc_info=None, **extra) -> logging.LogRecord:
    record = logging.getLogger("lorabatch.test").makeRecord("lorabatch.test", logging.WARNING, __file__, 1, msg, args, exc_info,
                                                             extra=extra or None)
    return record


@pytest.mark.parametrize(("msg", "args"), [
    ("it's \"quoted\" and \\ back", ()),
    ("two\nlines\tand\r\n more", ()),
    ("lone surrogate \ud800 and emoji 🚀 and NUL \x00", ()),
    ("assigned %s", ([("lorabatch.jobs", 0)],)),
    ("%d of %s", (3, {"a": b"bytes"})),
    ("%d broken format", ("not a number",)),
    ("", ()),
    ("x" * 100_000, ()),
])
def test_every_message_is_one_json_object(msg, args):
    line = JsonFormatter().format(_record(msg, *args))
    assert "\n" not in line
    obj = json.loads(line)
    assert set(obj) == {"ts", "level", "logger", "msg"} and obj["level"] == "WARNING" and obj["logger"] == "lorabatch.test"
    assert obj["ts"].endswith("Z") and "T" in obj["ts"]
    if "broken" not in msg:
        assert obj["msg"] == (msg % args if args else msg)


def test_extra_fields_and_tracebacks_are_fields():
    try:
        raise RuntimeError("boom 'quoted'\nsecond line")
    except RuntimeError:
        record = _record("failed %s", "x", exc_info=sys.exc_info(), partition=3, tenant="acme", level="clash", obj=object())
    obj = json.loads(JsonFormatter().format(record))
    assert obj["partition"] == 3 and obj["tenant"] == "acme" and obj["extra_level"] == "clash" and obj["level"] == "WARNING"
    assert obj["obj"].startswith("<object object")
    assert obj["exc"].startswith("Traceback (most recent call last)") and "RuntimeError: boom 'quoted'\nsecond line" in obj["exc"]


def test_json_logging_replaces_earlier_handlers_and_takes_warnings():
    stream = io.StringIO()
    root = logging.getLogger()
    before = root.handlers[:], root.level
    try:
        logging.basicConfig(format="%(message)s")  # a handler of someone else's, already there
        json_logging("INFO", stream)
        logging.getLogger("lorabatch.x").info("hello %s", "there")
        import warnings

        warnings.warn("a library's warning")
        logging.getLogger("aiokafka").info("connection chatter")
        lines = stream.getvalue().splitlines()
        objs = [json.loads(x) for x in lines]
        assert [o["msg"] for o in objs][0] == "hello there"
        assert any("a library's warning" in o["msg"] for o in objs) and not any("chatter" in o["msg"] for o in objs)
    finally:
        logging.captureWarnings(False)
        root.handlers[:], _ = before[0], root.setLevel(before[1])



def test_json_logging_keeps_libraries_info_out():
    """Libraries log from WARNING (alembic's INFO at the worker's schema check is chatter); lorabatch's own
    modules, under `lorabatch.*` or their package names (`consumer.rules`), log from the level asked for."""
    stream = io.StringIO()
    root = logging.getLogger()
    before = root.handlers[:], root.level
    try:
        json_logging("INFO", stream)
        logging.getLogger("alembic.runtime.plugins").info("setup plugin alembic.autogenerate.schemas")
        logging.getLogger("alembic.runtime.migration").warning("a library's warning")
        logging.getLogger("consumer.rules").info("rule note")
        logging.getLogger("engine.host_arena").info("arena note")
        logging.getLogger("lorabatch.worker").info("worker note")
        msgs = [json.loads(x)["msg"] for x in stream.getvalue().splitlines()]
        assert msgs == ["a library's warning", "rule note", "arena note", "worker note"], msgs
    finally:
        logging.captureWarnings(False)
        root.handlers[:], _ = before[0], root.setLevel(before[1])

def _error(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, "x.py", 1, msg, args, None)


@pytest.mark.parametrize("name, msgs, times, written, left_out", [
    # aiokafka's retries with the broker dead, a line each per ~0.1 s: the first, then one every 30 s with the count
    ("aiokafka", ["Unable connect to node with id %s: %s"] * 5, [0, 0.1, 0.2, 30.0, 30.1], [0, 3], [None, 2]),
    # each message of a library is its own: both are written
    ("aiokafka", ["Unable to update metadata from %s", "Unable connect to node with id %s: %s"], [0, 0.1], [0, 1], [None, None]),
    # asyncio's "Task exception was never retrieved" names each task on its second line: one message
    ("asyncio", ["Task exception was never retrieved\nfuture: <Task-1>", "Task exception was never retrieved\nfuture: <Task-2>"],
     [0, 1], [0], [None]),
    # lorabatch's own records are never held back (they summarise themselves)
    ("lorabatch.worker", ["waiting for the broker"] * 3, [0, 0.1, 0.2], [0, 1, 2], [None] * 3),
    ("aiokafka", [], [], [], []),  # nothing logged, nothing written
])
def test_library_repeats_are_written_once_every_30_s_with_a_count(name, msgs, times, written, left_out):
    """A library's record repeating (aiokafka at each retry while the broker is dead: 8,871 lines in 80 s) is
    written once per logger and message every 30 s; the next one written says how many were left out."""
    clock = iter(times)
    f = LibraryRepeats(30.0, clock=lambda: next(clock))
    records = [_error(name, m, 111, "refused") for m in msgs]
    kept = [i for i, r in enumerate(records) if f.filter(r)]
    assert kept == written, kept
    assert [getattr(records[i], "left_out", None) for i in kept] == left_out


@pytest.mark.slow
async def test_a_worker_writes_only_json_lines(broker, tmp_path, demo_set):
    """A worker process run over good jobs, a failing one, unparsable messages and SIGTERM: every line it wrote to
    stderr parses with json.loads and has ts, level, logger and msg."""
    from billing.db import upgrade
    from migrations import SCRIPT_LOCATION

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url, script_location=SCRIPT_LOCATION)
    s = await service_settings(broker, tmp_path, url, demo_set["model"], **{"kafka.partitions": 1})
    svc = open_services(s)
    svc.registry.add_tenant("acme")
    svc.registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]], default=True)
    svc.close()
    config = tmp_path / "worker.toml"
    config.write_text(s.to_toml())
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "--config", str(config), "--worker-id", "json-w"],
                                stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        jobs = [Job(request_id=f"j{i}", tenant_id="acme", prompt=f"it's \"job\" {i}\n", max_new_tokens=2) for i in range(4)]
        jobs.append(Job(request_id="bad", tenant_id="acme", adapter="missing", prompt="x", max_new_tokens=2))
        await produce_jobs(s.kafka, jobs, "b", "acme", "test", "tenant")
        await produce_raw(s, [b"{not json", "{\"request_id\": \"r\\ud800\"}".encode(), b"\xff\xfe"])
        wanted = {j.request_id for j in jobs}
        got = await read_all(s, s.kafka.results_topic, Result, lambda r: {x.request_id for x in r} >= wanted or proc.poll() is not None, 180)
        assert {r.request_id for r in got} >= wanted, log_path.read_text()[-3000:]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    lines = [x for x in log_path.read_text(encoding="utf-8").splitlines() if x.strip()]
    assert len(lines) >= 3, lines
    bad = []
    for line in lines:
        try:
            obj = json.loads(line)
            assert isinstance(obj, dict) and {"ts", "level", "logger", "msg"} <= obj.keys()
        except (ValueError, AssertionError):
            bad.append(line)
    assert bad == [], f"{len(bad)} of {len(lines)} lines are not JSON log objects: {bad[:3]}"
