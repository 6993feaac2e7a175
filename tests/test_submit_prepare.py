"""`lorabatch submit` input: native and OpenAI Batch API lines become jobs; bad lines are named by number."""

import json

from consumer.schemas import Result, Usage
from consumer.submit import partition_key, prepare, to_openai_line


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
    assert (native.request_id, native.tenant_id, native.batch_id, native.adapter) == ("b1-1", "acme", "b1", "support")
    assert chat.request_id == "c-1" and chat.adapter == "legal@2" and chat.max_new_tokens == 12
    assert chat.messages[0].content == "hi" and chat.stop == ["END"] and chat.logprobs == 3 and chat.temperature == 0.5
    assert comp.prompt == "x" and comp.adapter == "legal"


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
