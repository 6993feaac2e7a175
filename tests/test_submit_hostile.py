"""`lorabatch submit` and `lorabatch results` used clumsily: a batch id given to a second, different file, and the like.

Every line of a file produces exactly one job or is reported by its number with the field and the fix; a job's answer is
that job's, never another line's.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from consumer.cli import build_app
from tests.test_submit_results import _config_file, _settings

app = build_app()
runner = CliRunner()


def _finished(call):
    """call()'s value, from a thread: a command that hangs fails the test rather than hanging it."""
    got = []
    t = threading.Thread(target=lambda: got.append(call()), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the command never ended"
    return got[0]


def _chat(custom_id: str, text: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "support", "messages": [{"role": "user", "content": text}]}}


def _submit(tmp_path, config: str, name: str, lines: list[dict], *extra: str):
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return runner.invoke(app, ["submit", str(path), "--tenant", "acme", "--batch-id", "b1", "--config", config, *extra])


def _summary(out) -> dict:
    return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])


def test_a_second_file_under_a_batch_id_cannot_take_the_first_files_answers(broker, tmp_path):
    """A request id is answered once: a second file under the same --batch-id whose line 2 (its id made from the line's
    number) or whose custom_id `q1` is another job than the first file's was produced and answered with the first file's
    result, silently. Such lines are refused by number, naming the id and the fix; lines the same as before, and new
    ids, are submitted (the same file again still completes a batch cut short)."""
    _, overrides = _settings(broker)
    config = _config_file(tmp_path, overrides)
    first = [{"prompt": "one"}, {"prompt": "two"}, _chat("q1", "where is my order?")]
    out = _submit(tmp_path, config, "first.jsonl", first)
    assert out.exit_code == 0 and _summary(out) == {"batch_id": "b1", "submitted": 3, "rejected": 0}, out.output
    again = _submit(tmp_path, config, "first.jsonl", first)
    assert again.exit_code == 0 and _summary(again)["rejected"] == 0, again.output

    second = [{"prompt": "one"}, {"prompt": "something else"}, _chat("q1", "cancel my order"), _chat("q2", "new")]
    out = _submit(tmp_path, config, "second.jsonl", second, "--key", "request")
    said = " ".join(out.output.split())
    assert out.exit_code == 1 and _summary(out) == {"batch_id": "b1", "submitted": 2, "rejected": 2}, out.output
    assert "line 2: request id 'b1-2' (made from the line's number) was submitted in batch 'b1' before, with another job" in said
    assert "line 3: custom_id 'q1' was submitted in batch 'b1' before" in said
    assert "first.jsonl" in said and "submit this file under another --batch-id" in said


def test_results_that_fail_while_written_leave_the_file_there_before_as_it_was(tmp_path, monkeypatch):
    """-o names a file a first collection wrote; a second one that fails half way through writing (here: the disk full
    at its second line) fails naming the file and leaves that file as it was, with no part file beside it: the file was
    opened with truncation before the first line, so it held one line of the two."""
    import errno

    from consumer import openai_batch, submit
    from consumer.broker import free_port
    from consumer.schemas import BatchManifest, Result

    async def manifest(*args, **kwargs):
        return BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1", "r2"])

    async def collected(cfg, manifest, timeout_s, progress=None, contested=None):
        return {rid: Result(request_id=rid, tenant_id="acme", batch_id="b1", status="succeeded", text=rid) for rid in ("r1", "r2")}, {}

    written = openai_batch.to_openai_line

    def disk_full(result, *args):
        if result.request_id == "r2":
            raise OSError(errno.ENOSPC, "No space left on device")
        return written(result, *args)

    monkeypatch.setattr(submit, "read_manifest", manifest)
    monkeypatch.setattr(submit, "collect_results", collected)
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    target = tmp_path / "out.jsonl"
    args = ["results", "--tenant", "acme", "--batch-id", "b1", "--format", "openai", "-o", str(target), "--config", config]
    assert runner.invoke(app, args).exit_code == 0
    before = target.read_text()
    assert [json.loads(line)["custom_id"] for line in before.splitlines()] == ["r1", "r2"]
    monkeypatch.setattr(openai_batch, "to_openai_line", disk_full)
    out = runner.invoke(app, args)
    assert out.exit_code == 2 and f"cannot write -o {target}: No space left on device" in " ".join(out.output.split())
    assert target.read_text() == before and sorted(p.name for p in tmp_path.iterdir()) == ["lorabatch.toml", "out.jsonl"]


def test_a_request_failed_for_a_retry_and_sent_again_is_collected_with_its_new_answer(broker):
    """quota_exceeded (on_quota=fail) says "retry later" and is not kept by the workers: the file submitted again under its
    batch id runs the request again. `results` kept the first result it read, so the batch was collected with the
    quota failure for good. A retriable failure gives way to a later result of its request; any other result stays the
    first read (r2's invalid_job, then a stray success, is still invalid_job)."""
    import asyncio

    from consumer.schemas import BatchManifest, ErrorInfo, Result
    from consumer.submit import collect_results
    from tests.test_submit_results import _produce

    s, _ = _settings(broker)

    def result(rid: str, code: str | None = None, retriable: bool = False) -> bytes:
        error = None if code is None else ErrorInfo(code=code, message=code, retriable=retriable)
        return Result(request_id=rid, tenant_id="acme", batch_id="b1", status="failed" if error else "succeeded",
                      text="" if error else f"{rid} ran", error=error).model_dump_json().encode()

    asyncio.run(_produce(s, s.kafka.results_topic, [result("r1", "quota_exceeded", retriable=True), result("r2", "invalid_job"),
                                                     result("r3"), result("r1"), result("r2")], key=b"acme"))
    manifest = BatchManifest(batch_id="b1", tenant_id="acme", request_ids=["r1", "r2", "r3"])
    got, dlq = asyncio.run(collect_results(s.kafka, manifest, 20))
    assert {rid: (r.status, r.error and r.error.code, r.text) for rid, r in got.items()} == {
        "r1": ("succeeded", None, "r1 ran"), "r2": ("failed", "invalid_job", ""), "r3": ("succeeded", None, "r3 ran")}


def test_an_id_that_submit_made_for_an_earlier_line_is_named_as_such(tmp_path):
    """Line 1 gives no request_id (submit makes b1-1) and line 3 gives request_id b1-1: line 3 was refused as "appears
    twice (first on line 1)", a line that holds no such id. It is refused naming the made id and both fixes."""
    from consumer.batch_file import prepare

    path = tmp_path / "jobs.jsonl"
    path.write_text('{"prompt": "a"}\n{"request_id": "x", "prompt": "b"}\n{"request_id": "b1-1", "prompt": "c"}\n'
                    '{"request_id": "x", "prompt": "d"}\n')
    out = prepare(path, "acme", "b1")
    assert [j.request_id for j in out.jobs] == ["b1-1", "x"]
    assert out.errors == ["line 3: request_id 'b1-1' is the id submit made for line 1, which gives no request_id; give this line "
                          "another request_id, or line 1 one of its own",
                          "line 4: request_id 'x' appears twice (first on line 2); request ids are unique per tenant"]


@pytest.mark.parametrize("kind", ["fifo", "link-to-fifo", "directory"])
def test_results_refuses_an_output_it_cannot_write_before_it_waits(tmp_path, monkeypatch, kind):
    """-o naming a FIFO with no reader (or a link to one) or a folder is refused up front (exit 2), naming -o, what is
    there and the fix; the FIFO was opened for writing by the check made before the wait, which blocked for ever. Nothing
    is asked of the broker, and the FIFO is left as it was."""
    from consumer import submit
    from consumer.broker import free_port

    async def never(*args, **kwargs):
        raise AssertionError("the broker was asked before -o was checked")

    monkeypatch.setattr(submit, "read_manifest", never)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # no reader ever opens it
    target = {"fifo": fifo, "directory": tmp_path, "link-to-fifo": tmp_path / "link"}[kind]
    if kind == "link-to-fifo":
        target.symlink_to(fifo)
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    args = ["results", "--tenant", "acme", "--batch-id", "b1", "-o", str(target), "--config", config]
    out = _finished(lambda: runner.invoke(app, args))
    said = " ".join(out.output.split())
    what = "directory" if kind == "directory" else "FIFO (a named pipe) with no reader (start its reader first)"
    assert out.exit_code == 2 and f"cannot write -o {target}: it is a {what}" in said, out.output
    assert "give a file path, a FIFO whose reader is running, or leave -o out to write to stdout" in said, said
    assert fifo.is_fifo()


@pytest.mark.parametrize("kind", ["fifo-with-reader", "device"])
def test_results_pass_the_check_to_a_stream_that_can_take_them(tmp_path, monkeypatch, kind):
    """A FIFO whose reader runs (as `-o >(gzip > out.gz)` gives) and a character device (`-o /dev/stdout`) pass the
    check, and the command goes on to the broker; the FIFO's reader sees no end of input from the check."""
    from consumer import submit
    from consumer.broker import free_port

    class Asked(Exception):
        pass

    async def asked(*args, **kwargs):
        raise Asked

    monkeypatch.setattr(submit, "read_manifest", asked)
    target = Path("/dev/null")
    if kind == "fifo-with-reader":
        target = tmp_path / "fifo"
        os.mkfifo(target)
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK)  # the reader, there before the command
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    args = ["results", "--tenant", "acme", "--batch-id", "b1", "-o", str(target), "--config", config]
    out = _finished(lambda: runner.invoke(app, args))
    assert isinstance(out.exception, Asked), out.output
    if kind == "fifo-with-reader":
        os.set_blocking(fd, False)
        try:  # the command's descriptor is still open (it would write the results there): no end of input was sent
            os.read(fd, 10)
            raise AssertionError("the FIFO's reader saw an end of input")
        except BlockingIOError:
            pass
        finally:
            os.close(fd)


@pytest.mark.parametrize("kind", ["file", "device"])
def test_results_that_cannot_be_written_whole_name_the_file_and_keep_it(tmp_path, monkeypatch, kind):
    """A write that fails (a file size limit of 200 bytes, set once the results are in, stops it as a full disk would;
    /dev/full) ends with one line naming -o's path, the reason in words and the fix, and leaves the file there as it
    was; it said "[Errno 28] ... ; check the path and its permissions" (EFBIG, ENOSPC) without naming the file."""
    import resource

    from consumer import submit
    from consumer.broker import free_port
    from consumer.schemas import BatchManifest, Result

    ids = [f"r{i}" for i in range(50)]
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    async def manifest(*args, **kwargs):
        return BatchManifest(batch_id="b1", tenant_id="acme", request_ids=ids)

    async def collected(*args, **kwargs):
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, limit[1]))  # Python ignores SIGXFSZ: a write past it is EFBIG
        return {rid: Result(request_id=rid, tenant_id="acme", batch_id="b1", status="succeeded", text="x" * 100)
                for rid in ids}, {}

    monkeypatch.setattr(submit, "read_manifest", manifest)
    monkeypatch.setattr(submit, "collect_results", collected)
    target = tmp_path / "results.jsonl" if kind == "file" else Path("/dev/full")
    if kind == "file":
        target.write_text("the last run's results\n")
    config = _config_file(tmp_path, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}"})
    try:
        out = runner.invoke(app, ["results", "--tenant", "acme", "--batch-id", "b1", "-o", str(target), "--config", config])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    said = " ".join(out.output.split())
    reason = "File too large" if kind == "file" else "No space left on device"
    assert out.exit_code == 2, out.output
    assert f"cannot write -o {target}: {reason}" in said and "Errno" not in said, said
    if kind == "file":
        assert "the file there is as it was" in said, said
        assert target.read_text() == "the last run's results\n"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".results")] == []
