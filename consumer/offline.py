"""`lorabatch generate`: a JSONL batch straight through the engine, with no Kafka and no ledger."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from consumer.outcomes import engine_error_field, to_request
from consumer.schemas import Job
from engine.config import EngineConfig


def _line(request_id: str, **fields) -> str:
    return json.dumps({"request_id": request_id, **fields})


def run_offline(config: EngineConfig, adapters: dict[str, Path], jobs_path: Path) -> Iterator[str]:
    from engine.engine import Engine

    if not jobs_path.is_file():
        raise FileNotFoundError(f"--jobs {jobs_path}: no such file")
    engine = Engine(config)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    slots: list[str | int] = []  # a finished line, or the index of the request that will fill it
    requests, jobs = [], []
    for n, text in enumerate(jobs_path.read_text().splitlines(), start=1):
        if not text.strip():
            continue
        rid = f"line-{n}"
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object")
            data.setdefault("request_id", rid)
            data.setdefault("tenant_id", "local")
            rid = str(data["request_id"])
            job = Job.model_validate(data)
        except (json.JSONDecodeError, ValueError, ValidationError) as e:
            msg = e.errors()[0]["msg"] if isinstance(e, ValidationError) else str(e)
            field = ".".join(str(p) for p in e.errors()[0]["loc"]) if isinstance(e, ValidationError) else None
            slots.append(_line(rid, status="failed", error={"code": "invalid_job", "field": field, "message": f"line {n}: {msg}"}))
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

