"""`lorabatch submit` input: native and OpenAI Batch API lines become jobs; bad lines are named by number."""

import json

import pytest

from consumer.kafka import record_size
from consumer.schemas import Job, Result, Usage
from consumer.openai_batch import to_openai_line
from consumer.submit import job_message, manifest_parts, partition_key, prepare


def _write(tmp_path, lines):
    p = tmp_path / "in.jsonl"
    p.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    return p


def test_native_and_openai_lines(tmp_path):
    p = _write(tmp_path, [
        {"prompt": "hello", "adapter": "support", "max_new_tokens": 8},
        {"custom_id": "c-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "legal@2", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                  "max_tokens": 12, "temperature": 0.5, "stop": "END", "logprobs": True, "top_logprobs": 3}},
        {"custom_id": "c-2", "method": "POST", "url": "/v1/completions", "body": {"model": "legal", "prompt": "x"}},
    ])
    out = prepare(p, "acme", "b1")
    assert out.errors == []
    native, chat, comp = out.jobs
    assert (native.request_id, native.tenant_id, native.batch_id, native.adapter_ref) == ("b1-1", "acme", "b1", "support")
    assert chat.request_id == "b1:c-1" and chat.adapter_ref == "legal@2" and chat.max_new_tokens == 12
    assert chat.messages[0].content == "hi" and chat.stop == ["END"] and chat.logprobs == 3 and chat.temperature == 0.5
    assert comp.prompt == "x" and comp.adapter_ref == "legal"


def test_bad_lines_are_reported_with_their_number(tmp_path):
    p = _write(tmp_path, [
        {"prompt": "ok"},
        "{broken",
        {"prompt": "x", "max_new_tokens": 0},
        {"prompt": "x", "tenant_id": "other"},
        {"custom_id": "c", "body": "nope"},
        [1, 2],
        "",
    ])
    out = prepare(p, "acme", "b")
    assert len(out.jobs) == 1
    assert [e.split(":")[0] for e in out.errors] == ["line 2", "line 3", "line 4", "line 5", "line 6"]
    assert "max_new_tokens" in out.errors[1]
    assert "--tenant" in out.errors[2]


def test_a_line_that_is_not_utf8_is_named_and_the_rest_goes_on(tmp_path):
    """One line of other bytes (Latin-1 here) is a bad line with its number, not the whole file refused; a UTF-8 BOM
    before the first line is no content; a lone surrogate in a prompt is named by its field."""
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\n{"prompt": "caf\xe9"}\n{"prompt": "ok"}\n{"prompt": "x\\ud800"}\n')
    out = prepare(p, "acme", "b")
    assert [j.prompt for j in out.jobs] == ["first", "ok"]
    assert out.errors[0] == "line 2: not UTF-8 (byte 0xe9 at column 16); save the file as UTF-8", out.errors
    assert out.errors[1].startswith("line 4: prompt: holds a lone UTF-16 surrogate (\\ud800)"), out.errors


def test_duplicate_request_ids_are_refused(tmp_path):
    p = _write(tmp_path, [{"prompt": "a", "request_id": "same"}, {"prompt": "b", "request_id": "same"}])
    out = prepare(p, "acme", "b")
    assert len(out.jobs) == 1 and "appears twice" in out.errors[0]


def test_partition_keys(tmp_path):
    job = prepare(_write(tmp_path, [{"prompt": "a", "adapter": "x"}]), "acme", "b").jobs[0]
    assert partition_key(job, "tenant") == b"acme"
    assert partition_key(job, "adapter") == b"acme/x"
    assert partition_key(job, "request") == b"b-1"


def test_openai_output_line():
    ok = Result(request_id="r", tenant_id="t", status="succeeded", text="hi", finish_reason="eos",
                usage=Usage(input_tokens=3, output_tokens=2))
    line = to_openai_line(ok)
    assert line["custom_id"] == "r" and line["error"] is None
    assert line["response"]["body"]["choices"][0]["finish_reason"] == "stop"
    assert line["response"]["body"]["usage"]["total_tokens"] == 5


def test_duplicate_keeps_the_first_line(tmp_path):
    """The first line of a request id is the job; the later one is a rejected line naming the first."""
    p = _write(tmp_path, [{"prompt": "first", "request_id": "same"}, {"prompt": "ok"}, {"prompt": "second", "request_id": "same"}])
    out = prepare(p, "acme", "b")
    assert [j.prompt for j in out.jobs] == ["first", "ok"]
    assert out.errors == ["line 3: request_id 'same' appears twice (first on line 1); request ids are unique per tenant"]


def _sized(limit, size, key_by="tenant"):
    """A native job line whose Kafka record is exactly `size` bytes (keyed by `key_by`)."""
    job = {"prompt": "x", "request_id": "r", "adapter": "support"}
    base = record_size(*job_message(Job.model_validate(job | {"tenant_id": "acme", "batch_id": "b"}), key_by))
    return job | {"prompt": "x" * (1 + size - base)}


@pytest.mark.parametrize("key_by", ["tenant", "adapter", "request"])
@pytest.mark.parametrize(("over", "refused"), [(-1, False), (0, False), (1, True)])
def test_lines_over_the_message_limit_are_refused(tmp_path, key_by, over, refused):
    """A line whose record (key included) passes kafka.max_message_bytes is rejected with its number, size and the limit; at the limit it is sent."""
    limit = 2048
    p = _write(tmp_path, [{"prompt": "small"}, _sized(limit, limit + over, key_by)])
    out = prepare(p, "acme", "b", max_message_bytes=limit, key_by=key_by)
    assert [j.request_id for j in out.jobs] == (["b-1"] if refused else ["b-1", "r"])
    assert out.errors == ([f"line 2: the job is {limit + over} bytes as a Kafka message, over kafka.max_message_bytes={limit}; "
                           "shorten its prompt (workers dead-letter larger messages) or raise the limit"] if refused else [])


def test_no_limit_no_size_check(tmp_path):
    """Without a limit (offline callers), prepare checks only the contract."""
    out = prepare(_write(tmp_path, [_sized(1024, 5000)]), "acme", "b")
    assert len(out.jobs) == 1 and out.errors == []


@pytest.mark.parametrize(("ids", "limit", "parts"), [
    ([], 1024, 1),  # an empty batch still has its manifest
    ([f"b-{i}" for i in range(10)], 1024, 1),
    ([f"b-{i}" for i in range(400)], 1024, 5),
    (["r" * 128] * 3 + ["é" * 100], 1024, 2),
])
def test_manifest_parts_fit_the_limit(ids, limit, parts):
    """A manifest too big for one message is cut into parts that each fit and that hold every id in order."""
    got = manifest_parts("batch_0123456789abcdef", "acme", ids, "/some/where/jobs.jsonl", limit)
    assert len(got) == parts
    assert [rid for m in got for rid in m.request_ids] == ids
    for m in got:
        assert record_size(m.batch_id.encode(), m.model_dump_json().encode()) <= limit
        assert (m.tenant_id, m.batch_id, m.created_at) == ("acme", got[0].batch_id, got[0].created_at)


def test_a_key_given_twice_is_a_bad_line(tmp_path):
    """As the worker refuses it: submit used to send the last of the two values."""
    p = tmp_path / "in.jsonl"
    p.write_text('{"prompt": "a", "max_new_tokens": 999, "max_new_tokens": 2}\n{"prompt": "ok"}\n')
    out = prepare(p, "acme", "b")
    assert [j.prompt for j in out.jobs] == ["ok"]
    assert out.errors == ["line 1: key 'max_new_tokens' is given twice in one object; give each key once"], out.errors


def test_a_native_lines_nested_field_is_named_once(tmp_path):
    """A native line's error inside a list names the path once (it said messages.0.role.0.role, input_ids.2.2)."""
    out = prepare(_write(tmp_path, [{"messages": [{"role": "wizard", "content": "x"}]}, {"input_ids": [1, 2, -1]}]), "acme", "b")
    assert [e.split(":")[:2] for e in out.errors] == [["line 1", " messages.0.role"], ["line 2", " input_ids.2"]], out.errors
