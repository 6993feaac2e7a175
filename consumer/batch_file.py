"""A batch file's lines as jobs: native jobs or OpenAI Batch API lines, read one at a time, each line's fault named.

`lorabatch submit` reads a file of JSON lines, a line a job: a native job (the contract in schemas.py) or an OpenAI
Batch API line (`{"custom_id", "method", "url", "body": {...}}`, openai_batch.py). Each line is checked as the Kafka
message it becomes; a bad line is an error that names its number, its field and the fix, and the lines after it go on.
The file is read as it is produced (submit.py), so what is held at once is a line and the request ids seen so far.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from consumer.kafka import record_size
from consumer.openai_batch import body_field, from_openai_line, is_openai_line
from consumer.schemas import Ident, Job, OpenAIRequest, TenantId, describe, error_field, load_json


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
               key_by: str = "tenant") -> Iterator[Line]:
    """Parse and validate the file's lines one at a time, as they are read; bad lines are reported, not sent.

    Only the request ids seen so far are kept (to refuse one given twice), so a file of a million lines is read in
    the memory of its ids, not of its jobs. With `max_message_bytes` (kafka.max_message_bytes), a line whose job
    would be a Kafka message larger than that (keyed by `key_by`) is a bad line too. A line break is LF, CRLF or CR.
    """
    check_ids(tenant_id, batch_id)
    try:
        f = path.open("rb")
    except OSError as e:
        raise SubmitError(f"cannot read {path}: {e}") from e
    first_line: dict[str, int] = {}  # request_id -> the line that gave it first
    n = 0
    with f:
        while True:
            try:
                physical = f.readline()
            except OSError as e:
                raise SubmitError(f"cannot read {path} after line {n}: {e}") from e
            if not physical:
                return
            pieces = physical.splitlines(keepends=True)  # a CR alone breaks a line too, as bytes.splitlines has it
            for raw in pieces:
                n += 1
                yield _read_line(n, raw, tenant_id, batch_id, first_line, max_message_bytes, key_by)


def _read_line(n: int, raw: bytes, tenant_id: str, batch_id: str, first_line: dict[str, int], max_message_bytes: int | None,
               key_by: str) -> Line:
    """Line `n` (its bytes `raw`, line break included) as a job, or the error that names its field and the fix."""
    out = Line(n, len(raw))
    request, names = None, {}  # names: job field -> the OpenAI line's field, for errors
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM (a Windows editor's, or a file's joined on) is no content
        if not text.strip():
            return out
        data, repeated = load_json(text)
        if repeated:
            raise ValueError(f"key {repeated[0][0]!r} is given twice in one object; give each key once")
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object per line, got {_json_type(data)}; write one job object per line")
        if is_openai_line(data):
            line = from_openai_line(data, batch_id)
            data, request, names = line.job, line.request, line.names
        rid = data.get("request_id", f"{batch_id}-{n}")
        if isinstance(rid, str):
            if rid in first_line:  # whether or not that line was good: which of the two was meant cannot be told
                what = (f"custom_id {request.custom_id!r}", "custom ids are unique per batch") if request is not None \
                    else (f"request_id {rid!r}", "request ids are unique per tenant")
                raise ValueError(f"{what[0]} appears twice (first on line {first_line[rid]}); {what[1]}")
            first_line[rid] = n
        if data.get("tenant_id", tenant_id) != tenant_id:
            raise ValueError(f"tenant_id: {data['tenant_id']!r} differs from --tenant {tenant_id!r}; drop it or fix it")
        if isinstance(data.get("batch_id"), str) and data["batch_id"] != batch_id:  # its DLQ record would name the other batch
            raise ValueError(f"batch_id: {data['batch_id'][:160]!r} differs from the batch's id {batch_id!r}; drop it, or submit the "
                             f"file with --batch-id {data['batch_id'][:160]}")
        data["tenant_id"] = tenant_id
        data.setdefault("batch_id", batch_id)
        data.setdefault("request_id", rid)
        job = Job.model_validate(data)
        if max_message_bytes is not None:
            record = job_message(job, key_by)
            if (size := record_size(*record)) > max_message_bytes:
                raise ValueError(f"the job is {size} bytes as a Kafka message, over kafka.max_message_bytes={max_message_bytes}; "
                                 f"shorten its prompt (workers dead-letter larger messages) or raise the limit")
            out.record = record
        out.job, out.request = job, request
    except UnicodeDecodeError as e:
        out.error = f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8"
    except json.JSONDecodeError as e:
        out.error = f"line {n}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); {_json_fix(e.msg)}"
    except RecursionError:
        out.error = f"line {n}: the JSON nests too deeply; send a flat job object (the README's \"Job and result contract\")"
    except ValidationError as e:
        errors = e.errors(include_url=False)
        where = body_field(error_field(errors[0]) or "", names) or None
        out.error = f"line {n}: {describe(errors[0], len(errors), where).message}"
    except ValueError as e:
        out.error = f"line {n}: {e}"
    return out


def _json_type(value: object) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def _json_fix(msg: str) -> str:
    """What to do about a line the JSON decoder refused with `msg`."""
    if msg.startswith("Invalid control character"):
        return "escape control characters inside strings (\\n, \\t, \\u0000)"
    return "write each line as one JSON object (JSON Lines: one object a line, no line break inside it)"


def partition_key(job: Job, by: str) -> bytes:
    """The record key of a job; `adapter-balanced` keys by adapter too (its partition is chosen, not hashed)."""
    by = "adapter" if by == "adapter-balanced" else by
    value = {"tenant": job.tenant_id, "adapter": f"{job.tenant_id}/{job.adapter_ref or ''}", "request": job.request_id}[by]
    return value.encode()


def job_message(job: Job, key_by: str) -> tuple[bytes, bytes]:
    """The record a job is produced as: (key, value)."""
    return partition_key(job, key_by), job.model_dump_json(exclude_none=True).encode()
