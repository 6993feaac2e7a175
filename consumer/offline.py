"""`lorabatch generate`: a JSONL batch straight through the engine, with no Kafka and no ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from consumer.files import open_regular
from consumer.outcomes import engine_error_field, to_request
from consumer.schemas import Job, describe
from engine.config import EngineConfig


def _line(request_id: str, **fields) -> str:
    return json.dumps({"request_id": request_id, **fields})


def run_offline(config: EngineConfig, adapters: dict[str, Path], jobs_path: Path) -> Iterator[str]:
    from engine.engine import Engine

    try:  # read before the engine is built: one open, checked on what it opened (a FIFO there blocked read_bytes)
        with open_regular(jobs_path, what="--jobs", fix="give a JSONL file") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"--jobs {jobs_path}: no such file") from None
    engine = Engine(config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    slots: list[str | int] = []  # a finished line, or the index of the request that will fill it
    requests, jobs = [], []
    for n, raw in enumerate(data.splitlines(), start=1):
        rid = f"line-{n}"
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")  # a line of other bytes is that line's failure, a BOM no content
            if not text.strip():
                continue
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            data.setdefault("request_id", rid)
            data.setdefault("tenant_id", "local")
            rid = str(data["request_id"])
            job = Job.model_validate(data)
        except UnicodeDecodeError as e:
            slots.append(_line(rid, status="failed", error={"code": "invalid_job", "field": None, "message":
                               f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8"}))
            continue
        except ValidationError as e:
            errors = e.errors(include_url=False)
            info = describe(errors[0], len(errors))
            slots.append(_line(rid, status="failed", error={"code": "invalid_job", "field": info.field, "message": f"line {n}: {info.message}"}))
            continue
        except (json.JSONDecodeError, ValueError, RecursionError) as e:
            slots.append(_line(rid, status="failed", error={"code": "invalid_job", "field": None, "message": f"line {n}: {e}"}))
            continue
        if job.adapter_ref is not None and job.adapter_ref not in adapters:
            slots.append(_line(job.request_id, status="failed", error={
                "code": "unknown_adapter", "field": "adapter_ref",
                "message": f"adapter {job.adapter_ref!r} was not given; pass --adapter {job.adapter_ref}=DIR"}))
            continue
        slots.append(len(requests))
        requests.append(to_request(job, job.adapter_ref))  # offline, the adapters given by name are the engine's keys
        jobs.append(job)
    results = engine.generate(requests) if requests else []
    for slot in slots:
        if isinstance(slot, str):
            yield slot
            continue
        r = results[slot]
        if r.error is not None:
            field = engine_error_field(r.error.code, r.error.message, jobs[slot])
            yield _line(r.request_id, status="failed", error={"code": r.error.code, "field": field, "message": r.error.message})
            continue
        out = {"status": "succeeded", "adapter": r.adapter_key, "output_ids": r.output_ids, "text": r.text,
               "finish_reason": r.finish_reason,
               "usage": {"input_tokens": r.prompt_tokens, "output_tokens": len(r.output_ids),
                         "cached_tokens": r.timings.cached_tokens}}
        if r.logprobs is not None:
            out["logprobs"] = r.logprobs
        yield _line(r.request_id, **out)

