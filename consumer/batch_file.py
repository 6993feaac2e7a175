"""A batch file's lines as jobs: native jobs or OpenAI Batch API lines, read one at a time, each line's fault named.

`lorabatch submit` reads a file of JSON lines, a line a job: a native job (the contract in schemas.py) or an OpenAI
Batch API line (`{"custom_id", "method", "url", "body": {...}}`, openai_batch.py). Each line is checked as the Kafka
message it becomes; a bad line is an error that names its number, its field and the fix, and the lines after it go on.
The file is read as it is produced (submit.py), so what is held at once is a line and the request ids seen so far.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from consumer.kafka import record_size
from consumer.openai_batch import body_field, from_openai_line, is_openai_line
from consumer.schemas import BatchManifest, Ident, Job, OpenAIRequest, TenantId, describe, error_field, load_json


class SubmitError(Exception):
    retriable = False


@dataclass
class Line:
    """One line of a batch file: its job (with the OpenAI Batch line it came from), why it was refused, or neither
    (a blank line)."""

    number: int
    size: int  # the bytes of the file it took, its line break included
    job: Job | None = None
    request: OpenAIRequest | None = None
    error: str | None = None  # "line N: field: what to fix"
    record: tuple[bytes, bytes] | None = None  # (key, value) of its Kafka message, when sized against the limit
    digest: str | None = None  # job_digest of its job


def job_digest(value: bytes) -> str:
    """What a batch's manifest keeps of a job's Kafka value: 16 hex digits of its sha256."""
    return hashlib.sha256(value).hexdigest()[:16]


@dataclass
class Prepared:
    jobs: list[Job] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "line N: field: what to fix"
    openai: dict[str, OpenAIRequest] = field(default_factory=dict)  # request id -> its OpenAI Batch line


# The contract's identifiers (consumer.schemas.Ident, TenantId), in words for the options that give them.
_ID_RULES = {
    "--tenant": (TypeAdapter(TenantId), "1 to 64 ASCII letters, digits, '_', '.' or '-', the first a letter or digit"),
    "--batch-id": (TypeAdapter(Ident), "1 to 128 ASCII letters, digits, '_', '.', ':', '@', '/' or '-'"),
}


def check_ids(tenant_id: str, batch_id: str) -> None:
    """SubmitError naming the option if the tenant or batch id is not one the job contract takes: checked once, before
    any line (every line carries both, and each was rejected with the same message)."""
    for option, value in (("--tenant", tenant_id), ("--batch-id", batch_id)):
        adapter, rule = _ID_RULES[option]
        try:
            adapter.validate_python(value)
        except ValidationError:
            raise SubmitError(f"{option} {value[:160]!r} is not usable: write {rule}") from None


def prepare(path: Path, tenant_id: str, batch_id: str, *, max_message_bytes: int | None = None, key_by: str = "tenant") -> Prepared:
    """Every line of the file read at once (`read_lines`): the jobs, the bad lines' errors, the OpenAI index."""
    out = Prepared()
    for line in read_lines(path, tenant_id, batch_id, max_message_bytes=max_message_bytes, key_by=key_by):
        if line.error is not None:
            out.errors.append(line.error)
        elif line.job is not None:
            out.jobs.append(line.job)
            if line.request is not None:
                out.openai[line.job.request_id] = line.request
    return out


def read_lines(path: Path, tenant_id: str, batch_id: str, *, max_message_bytes: int | None = None,
               key_by: str = "tenant", submitted: BatchManifest | None = None) -> Iterator[Line]:
    """Parse and validate the file's lines one at a time, as they are read; bad lines are reported, not sent.

    Only the request ids seen so far are kept (to refuse one given twice), so a file of a million lines is read in
    the memory of its ids, not of its jobs. With `max_message_bytes` (kafka.max_message_bytes), a line whose job
    would be a Kafka message larger than that (keyed by `key_by`) is a bad line too. A line break is LF, CRLF or CR.
    `submitted`, the manifest of what was submitted under this batch id before: a line whose request id it holds with
    another job's digest is a bad line (the id is answered once, so it would be given the other job's result).
    """
    check_ids(tenant_id, batch_id)
    try:
        f = path.open("rb")
    except OSError as e:
        raise SubmitError(f"cannot read {path}: {e}") from e
    mode = os.fstat(f.fileno()).st_mode
    if stat.S_ISBLK(mode) or stat.S_ISCHR(mode) and not f.isatty():
        # A pipe or a terminal ends when its writer does; /dev/zero never does (its one line, read past, never ended).
        f.close()
        raise SubmitError(f"{path} is a device, not a batch file: reading it might never end; give a JSON lines file, "
                          f"or pipe the lines in (`... | lorabatch submit /dev/stdin ...`)")
    first_line: dict[str, int] = {}  # request_id -> the line that gave it first (negative: submit made it from the number)
    limit = None if max_message_bytes is None else LINE_FACTOR * max_message_bytes
    n = 0
    with f:
        for raw, size in _raw_lines(f, limit, lambda e: SubmitError(f"cannot read {path} after line {n}: {e}")):
            n += 1
            if raw is None:
                yield Line(n, size, error=f"line {n}: {size} bytes long, over {LINE_FACTOR} times "
                                          f"kafka.max_message_bytes={max_message_bytes}: no job fits a Kafka message from "
                                          f"such a line, so it was skipped unread; shorten its prompt, or check that the file "
                                          f"is JSON Lines (one object a line)")
            else:
                line = _read_line(n, raw, tenant_id, batch_id, first_line, max_message_bytes, key_by)
                if line.job is not None and submitted is not None:
                    _check_resubmitted(line, batch_id, submitted)
                yield line


# A line may be longer than the job it becomes (a "\u0061" escape is 6 bytes of the line and 1 of the job; OpenAI
# fields such as `metadata` are dropped), but not 8 times longer: a longer line is read past, never held (a 200 MB line
# was 1,040 MB of memory held whole, to be refused as over the 1 MB message limit).
LINE_FACTOR = 8
_BLOCK = 1 << 20  # bytes asked of the file a read
_BREAK = re.compile(rb"\r\n?|\n")  # LF, CRLF or CR, as bytes.splitlines has them


def _raw_lines(f, limit: int | None, failed) -> Iterator[tuple[bytes | None, int]]:
    """(the line's bytes, its break included, or None where over `limit` bytes, its size) for each line of `f`: a
    line over the limit is read past, not held. `failed(OSError)` is the exception to raise for a read that fails."""
    buf = b""
    skipped = 0  # bytes read so far of a line over the limit
    while True:
        try:
            block = f.read1(_BLOCK)  # what is there: a pipe's lines are taken as they come, not once 1 MB has
        except OSError as e:
            raise failed(e) from e
        buf += block
        pos = 0
        while (m := _BREAK.search(buf, pos)) is not None:
            if block and m.end() == len(buf) and buf.endswith(b"\r"):
                break  # the LF of a CRLF may be in the next block
            line, pos = buf[pos:m.end()], m.end()
            size = skipped + len(line)
            yield (None if skipped or (limit is not None and size > limit) else line), size
            skipped = 0
        buf = buf[pos:]
        if not block:
            if buf or skipped:
                size = skipped + len(buf)
                yield (None if skipped or (limit is not None and size > limit) else buf), size
            return
        if limit is not None and len(buf) > limit:
            cr = buf.endswith(b"\r")  # the line's break, CR or the CR of a CRLF: kept for the next read to tell which
            skipped += len(buf) - cr
            buf = b"\r" if cr else b""


def _read_line(n: int, raw: bytes, tenant_id: str, batch_id: str, first_line: dict[str, int], max_message_bytes: int | None,
               key_by: str) -> Line:
    """Line `n` (its bytes `raw`, line break included) as a job, or the error that names its field and the fix."""
    out = Line(n, len(raw))
    request, names = None, {}  # names: job field -> the OpenAI line's field, for errors
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM (a Windows editor's, or a file's joined on) is no content
        if not text.strip():
            return out
        try:
            data, repeated = load_json(text)
        except json.JSONDecodeError:
            raise
        except ValueError:  # Python's: "Exceeds the limit (4300 digits) for integer string conversion ..."
            raise ValueError("a number of more than 4,300 digits, which no field takes; write numbers in the range their "
                             "field takes (the README's \"Job and result contract\")") from None
        if repeated:
            raise ValueError(f"key {repeated[0][0]!r} is given twice in one object; give each key once")
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object per line, got {_json_type(data)}; write one job object per line")
        if is_openai_line(data):
            line = from_openai_line(data, batch_id)
            data, request, names = line.job, line.request, line.names
        made = "request_id" not in data
        rid = data.get("request_id", f"{batch_id}-{n}")
        if isinstance(rid, str):
            if rid in first_line:  # whether or not that line was good: which of the two was meant cannot be told
                what = (f"custom_id {request.custom_id!r}", "custom ids are unique per batch") if request is not None \
                    else (f"request_id {rid!r}", "request ids are unique per tenant")
                first = first_line[rid]
                if first < 0:  # the first line gave none: the id is the one submit made for it, which its user never wrote
                    raise ValueError(f"{what[0]} is the id submit made for line {-first}, which gives no request_id; give this "
                                     f"line another request_id, or line {-first} one of its own")
                raise ValueError(f"{what[0]} appears twice (first on line {first}); {what[1]}")
            first_line[rid] = -n if made else n
        if data.get("tenant_id", tenant_id) != tenant_id:
            raise ValueError(f"tenant_id: {data['tenant_id']!r} differs from --tenant {tenant_id!r}; drop it or fix it")
        if isinstance(data.get("batch_id"), str) and data["batch_id"] != batch_id:  # its DLQ record would name the other batch
            raise ValueError(f"batch_id: {data['batch_id'][:160]!r} differs from the batch's id {batch_id!r}; drop it, or submit the "
                             f"file with --batch-id {data['batch_id'][:160]}")
        data["tenant_id"] = tenant_id
        data.setdefault("batch_id", batch_id)
        data.setdefault("request_id", rid)
        job = Job.model_validate(data)
        record = job_message(job, key_by)
        out.digest = job_digest(record[1])
        if max_message_bytes is not None:
            if (size := record_size(*record)) > max_message_bytes:
                raise ValueError(f"the job is {size} bytes as a Kafka message, over kafka.max_message_bytes={max_message_bytes}; "
                                 f"shorten its prompt (workers dead-letter larger messages) or raise the limit")
            out.record = record
        out.job, out.request = job, request
    except UnicodeDecodeError as e:
        utf16 = " (it starts with a UTF-16 byte order mark)" if n == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        out.error = f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}){utf16}; save the file as UTF-8"
    except json.JSONDecodeError as e:
        out.error = f"line {n}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); {_json_fix(e.msg, e.doc)}"
    except RecursionError:
        out.error = f"line {n}: the JSON nests too deeply; send a flat job object (the README's \"Job and result contract\")"
    except ValidationError as e:
        errors = e.errors(include_url=False)
        where = body_field(error_field(errors[0]) or "", names) or None
        out.error = f"line {n}: {describe(errors[0], len(errors), where).message}"
    except ValueError as e:
        out.error = f"line {n}: {e}"
    return out


def _check_resubmitted(line: Line, batch_id: str, submitted: BatchManifest) -> None:
    """Refuse `line` (its job set) when batch `batch_id` already holds its request id for another job."""
    rid = line.job.request_id
    before = submitted.digests.get(rid)
    if before is None or before == line.digest:
        return
    if line.request is not None:
        what = f"custom_id {line.request.custom_id[:80]!r}"
    elif rid == f"{batch_id}-{line.number}":
        what = f"request id {rid!r} (made from the line's number)"
    else:
        what = f"request_id {rid!r}"
    line.error = (f"line {line.number}: {what} was submitted in batch {batch_id!r} before, with another job (from "
                  f"{submitted.source or 'another file'}); it would be answered with that job's result, not run: give the "
                  f"line an id of its own, or submit this file under another --batch-id")
    line.job = line.request = line.record = None


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _json_fix(msg: str, text: str) -> str:
    """What to do about a line `text` the JSON decoder refused with `msg`."""
    if msg.startswith("Invalid control character"):
        return "escape control characters inside strings (\\n, \\t, \\u0000)"
    line = text.strip()
    if line[:1] in ("[", "]") or (msg.startswith("Extra data") and line.endswith(",")):
        # A JSON array written an element a line: "[", then "{...},", then "]".
        return "a JSON array is not JSON Lines: write each of its objects on a line of its own, without the brackets and commas"
    return "write each line as one JSON object (JSON Lines: one object a line, no line break inside it)"


def partition_key(job: Job, by: str) -> bytes:
    """The record key of a job; `adapter-balanced` keys by adapter too (its partition is chosen, not hashed)."""
    by = "adapter" if by == "adapter-balanced" else by
    value = {"tenant": job.tenant_id, "adapter": f"{job.tenant_id}/{job.adapter_ref or ''}", "request": job.request_id}[by]
    return value.encode()


def job_message(job: Job, key_by: str) -> tuple[bytes, bytes]:
    """The record a job is produced as: (key, value)."""
    return partition_key(job, key_by), job.model_dump_json(exclude_none=True).encode()
