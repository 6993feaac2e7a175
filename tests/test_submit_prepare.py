"""`lorabatch submit` input: native and OpenAI Batch API lines become jobs; bad lines are named by number."""

import json

import pytest

from consumer.kafka import record_size
from consumer.schemas import Job, Result, Usage
from consumer.openai_batch import to_openai_line
from consumer.batch_file import job_message, partition_key, prepare, read_lines
from consumer.submit import manifest_parts


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


def test_a_bad_value_inside_a_list_is_named_by_its_path(tmp_path):
    """An error inside a field's list or object names its path once, as the worker's failed result does (error.field):
    `stop.0`, `messages.0.role`; it was `stop.0.0` and `messages.0.role.0.role` for native lines."""
    p = _write(tmp_path, [
        {"prompt": "x", "stop": [""]},
        {"messages": [{"role": "bot", "content": "x"}]},
        {"input_ids": [1, -1]},
        {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["x" * 65]}},
    ])
    out = prepare(p, "acme", "b")
    assert [e.split(": ")[1] for e in out.errors] == ["stop.0", "messages.0.role", "input_ids.1", "body.stop.0"], out.errors


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


@pytest.mark.parametrize(("line", "says"), [
    # a nested field's path once (it was messages.0.role.0.role), with what the field takes
    ({"messages": [{"role": "wizard", "content": "x"}]}, "line 1: messages.0.role: Input should be 'system', 'user', 'assistant' or 'tool'; "
                                                         "send a non-empty list of"),
    ({"input_ids": [1, 2, -1]}, "line 1: input_ids.2: Input should be greater than or equal to 0; send a value in 0..2147483647"),
    ({"prompt": "x", "stop": [""]}, "line 1: stop.0: String should have at least 1 character; send a list of up to 8 strings"),
    ({"prompt": "x", "stop": ["\ud800"]}, "line 1: stop.0: holds a lone UTF-16 surrogate (\\ud800)"),
    # the range, as the worker's failed result gives it
    ({"prompt": "x", "max_new_tokens": 200_000}, "line 1: max_new_tokens: Input should be less than or equal to 131072; send a value in 1..131072"),
    ({"prompt": "x", "max_new_tokens": True}, "line 1: max_new_tokens: Input should be a valid integer; send a value in 1..131072"),
    ({"prompt": "x", "temperature": "0.5"}, "line 1: temperature: Input should be a valid number; send a value in 0.0..5.0"),
    ({"prompt": "x", "allow_base_fallback": "true"}, "line 1: allow_base_fallback: Input should be a valid boolean; send true or false"),
    # JSON the decoder refuses: what is wrong once ("at at column" before), and the fix
    ('{"prompt": "a\tb"}', "line 1: not valid JSON (Invalid control character at column 14); escape control characters inside strings"),
    ('{"prompt": "a"} {"prompt": "b"}', "line 1: not valid JSON (Extra data at column 17); write each line as one JSON object"),
    ('{"prompt": "a", }', "line 1: not valid JSON (Expecting property name enclosed in double quotes at column 17); write each line"),
    ("[1, 2]", "line 1: expected a JSON object per line, got an array; write one job object per line"),
    ({"prompt": "x", "batch_id": "other"}, "line 1: batch_id: 'other' differs from the batch's id 'b'; drop it, or submit the file with --batch-id other"),
])
def test_a_bad_line_names_its_field_and_the_fix(tmp_path, line, says):
    """Each refusal says what the field takes, as the worker's failed result does; the good line after it still goes."""
    out = prepare(_write(tmp_path, [line, {"prompt": "ok"}]), "acme", "b")
    assert [j.prompt for j in out.jobs] == ["ok"]
    assert len(out.errors) == 1 and out.errors[0].startswith(says), out.errors


def test_a_bom_and_line_breaks_of_any_kind_are_no_content(tmp_path):
    """A BOM before any line (files joined with cat, each saved by a Windows editor) is no content; CRLF and CR break
    lines as LF does. The second file's BOM was 'Unexpected UTF-8 BOM (decode using utf-8-sig)'."""
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\r\n\xef\xbb\xbf{"prompt": "b"}\r\n{"prompt": "c"}\r{"prompt": "d"}\n\r\n')
    out = prepare(p, "acme", "b")
    assert out.errors == [] and [(j.request_id, j.prompt) for j in out.jobs] == [("b-1", "a"), ("b-2", "b"), ("b-3", "c"), ("b-4", "d")]


def test_an_id_given_twice_is_refused_even_where_its_first_line_was_bad(tmp_path):
    """Which of two lines with one id was meant cannot be told: the second is refused whether or not the first was good
    (it went, and once the first was fixed and the file sent again, the first was answered with the second's answer)."""
    chat = {"method": "POST", "url": "/v1/chat/completions"}
    p = _write(tmp_path, [
        {"custom_id": "a", **chat, "body": {"messages": [{"role": "user", "content": "first"}], "max_tokens": "5"}},
        {"custom_id": "a", **chat, "body": {"messages": [{"role": "user", "content": "second"}]}},
        {"request_id": "r", "prompt": ""},
        {"request_id": "r", "prompt": "second"},
        {"prompt": "ok"},
    ])
    out = prepare(p, "acme", "b")
    assert [j.prompt for j in out.jobs] == ["ok"]
    assert [e.split(";")[0] for e in out.errors] == [
        "line 1: body.max_tokens: Input should be a valid integer",
        "line 2: custom_id 'a' appears twice (first on line 1)",
        "line 3: prompt: is empty",
        "line 4: request_id 'r' appears twice (first on line 3)",
    ]


def test_lines_are_read_as_they_are_taken(tmp_path):
    """read_lines hands each line on before it reads the next: a file is never read whole (a million lines took 2.4 GB)."""
    p = _write(tmp_path, [{"prompt": "a"}, {"prompt": "b"}])
    lines = read_lines(p, "acme", "b")
    first = next(lines)
    assert first.job.prompt == "a" and first.size == len('{"prompt": "a"}\n')
    with p.open("a") as f:  # written after the first line was taken: still read
        f.write('{"prompt": "c"}\n')
    assert [line.job.prompt for line in lines] == ["b", "c"]
