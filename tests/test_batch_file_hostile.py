"""`lorabatch submit` input a hostile or careless tenant writes: over-long lines, numbers of thousands of digits,
JSON arrays, UTF-16. Each bad line is named by number with its fix; the lines around it are not lost."""

import json
import tracemalloc

import pytest

import consumer.batch_file as batch_file
from consumer.batch_file import LINE_FACTOR, read_lines


def _outcomes(path, **kw):
    return [(line.number, line.size, line.error or (line.job.request_id if line.job else None))
            for line in read_lines(path, "acme", "b", **kw)]


def test_a_line_over_the_bound_is_read_past_not_held(tmp_path):
    """A line longer than LINE_FACTOR x kafka.max_message_bytes is refused by number without being held: a 200 MB
    one-line file took 1,040 MB of memory to be refused as over the 1 MB message limit. The lines around it still go."""
    limit = 4096
    p = tmp_path / "in.jsonl"
    with p.open("wb") as f:
        f.write(b'{"request_id": "before", "prompt": "a"}\n{"prompt": "')
        for _ in range(24):
            f.write(b"x" * (1 << 20))
        f.write(b'"}\r\n{"request_id": "after", "prompt": "b"}')  # the last line has no line break
    tracemalloc.start()
    try:
        out = _outcomes(p, max_message_bytes=limit)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [o[0] for o in out] == [1, 2, 3] and out[0][2] == "before" and out[2][2] == "after"
    assert sum(o[1] for o in out) == p.stat().st_size
    assert out[1][2].startswith(f"line 2: {out[1][1]} bytes long, over {LINE_FACTOR} times kafka.max_message_bytes={limit}")
    assert "shorten its prompt" in out[1][2]
    assert peak < 8 << 20, f"{peak} bytes held at once for a 24 MB line"


def test_a_line_at_the_bound_is_read_as_a_job(tmp_path):
    """A line of exactly the bound is read (a line may be longer than its job: whitespace, escapes); one byte more is
    refused unread."""
    limit = 1024
    p = tmp_path / "in.jsonl"
    job = b'{"prompt": "a"}'
    p.write_bytes(job + b" " * (LINE_FACTOR * limit - len(job) - 1) + b"\n")
    [(n, size, what)] = _outcomes(p, max_message_bytes=limit)
    assert size == LINE_FACTOR * limit and what == "b-1"
    p.write_bytes(job + b" " * (LINE_FACTOR * limit - len(job)) + b"\n")
    [(n, size, what)] = _outcomes(p, max_message_bytes=limit)
    assert what.startswith(f"line 1: {LINE_FACTOR * limit + 1} bytes long, over {LINE_FACTOR} times")


@pytest.mark.parametrize("block", [1, 2, 3, 7, 64])
def test_line_breaks_split_across_reads_count_once(tmp_path, monkeypatch, block):
    """LF, CRLF and CR lines read in blocks of any size give the same lines, numbers and sizes: a CRLF cut between two
    reads is one break, not a blank line that moves every later line's number."""
    p = tmp_path / "in.jsonl"
    p.write_bytes(b'{"prompt": "a"}\r\n\r\n{"prompt": "b"}\r{"prompt": "c"}\n\r{"prompt": "d"}\r\n{"prompt": "e"}')
    want = _outcomes(p, max_message_bytes=1024)
    assert [w[2] for w in want] == ["b-1", None, "b-3", "b-4", None, "b-6", "b-7"]
    monkeypatch.setattr(batch_file, "_BLOCK", block)
    assert _outcomes(p, max_message_bytes=1024) == want
    assert _outcomes(p) == want


def test_a_number_of_thousands_of_digits_names_no_python_setting(tmp_path):
    """max_tokens written with 5,001 digits: the error said "use sys.set_int_max_str_digits() to increase the limit",
    a fix for Python, not for the file."""
    p = tmp_path / "in.jsonl"
    body = '{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1' + "0" * 5000 + "}"
    p.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": ' + body + "}\n"
                 + json.dumps({"prompt": "ok"}) + "\n")
    out = _outcomes(p)
    assert out[1][2] == "b-2"
    assert out[0][2].startswith("line 1: a number of more than 4,300 digits") and "sys." not in out[0][2]


def test_a_json_array_and_a_utf16_file_are_named_as_such(tmp_path):
    """A pretty-printed JSON array ("[", "{...},", "]") and a UTF-16 file: each bad line says what the file is and how to
    write it instead; the array's last element, valid JSON Lines on its own, still goes."""
    p = tmp_path / "in.jsonl"
    p.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n')
    out = _outcomes(p)
    assert [o[2] if o[2] == "b-3" else o[2].split(";")[1].strip()[:30] for o in out] == [
        "a JSON array is not JSON Lines", "a JSON array is not JSON Lines", "b-3", "a JSON array is not JSON Lines"]
    p.write_bytes((json.dumps({"prompt": "a"}) + "\n").encode("utf-16"))
    assert "(it starts with a UTF-16 byte order mark); save the file as UTF-8" in _outcomes(p)[0][2]


@pytest.mark.parametrize("block", [1 << 20, 1000, 9015, 9016])
def test_a_cr_ending_a_line_read_past_at_the_end_of_a_read_is_its_break(tmp_path, monkeypatch, block):
    """A line over the bound whose CR break is the last byte of a read (a pipe's writer wrote the line, CR and all): the
    CR was dropped with the line's bytes, so the next line was read as the rest of it, lost, and every later line took
    the number (and the made request id) of the one before it."""
    p = tmp_path / "in.jsonl"
    first = b'{"prompt": "' + b"x" * 9000 + b'"}\r'  # 9,015 bytes, over 8 x 1,024
    p.write_bytes(first + b'{"prompt": "a"}\r{"prompt": "b"}\r')
    monkeypatch.setattr(batch_file, "_BLOCK", block)
    out = _outcomes(p, max_message_bytes=1024)
    assert [(n, size) for n, size, _ in out] == [(1, len(first)), (2, 16), (3, 16)]
    assert out[0][2].startswith("line 1: 9015 bytes long") and [o[2] for o in out[1:]] == ["b-2", "b-3"]
