"""`lorabatch submit` and `lorabatch results`: batch files in, results out, through Kafka.

Input lines are native jobs (the contract in schemas.py) or OpenAI Batch API lines
(`{"custom_id", "method", "url", "body": {"model", "prompt" | "messages", "max_tokens", ...}}`), where
`body.model` names the adapter. Each submission writes a manifest (batch id, request ids) to the
batches topic so that `results` knows when the batch is complete.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import TopicPartition
from pydantic import ValidationError

from consumer.config import KafkaConfig
from consumer.kafka import make_consumer, make_producer
from consumer.schemas import BatchManifest, DlqRecord, Job, Result


class SubmitError(Exception):
    retriable = False


@dataclass
class Prepared:
    jobs: list[Job] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # "line N: field: what to fix"


def _from_openai(line: dict) -> dict:
    body = line.get("body")
    if not isinstance(body, dict):
        raise ValueError("body: missing or not an object; an OpenAI batch line carries the request in `body`")
    job: dict = {"request_id": line.get("custom_id")}
    if "model" in body:
        job["adapter"] = body["model"]
    for src, dst in (("prompt", "prompt"), ("messages", "messages"), ("max_tokens", "max_new_tokens"),
                     ("max_completion_tokens", "max_new_tokens"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("seed", "seed"), ("stop", "stop"), ("user", "user_id")):
        if src in body:
            job[dst] = body[src]
    if isinstance(job.get("stop"), str):
        job["stop"] = [job["stop"]]
    if body.get("logprobs") is True:
        job["logprobs"] = int(body.get("top_logprobs", 0))
    elif isinstance(body.get("logprobs"), int):
        job["logprobs"] = body["logprobs"]
    if isinstance(job.get("messages"), list):  # content parts -> plain text
        for m in job["messages"]:
            if isinstance(m, dict) and isinstance(m.get("content"), list):
                m["content"] = "".join(p.get("text", "") for p in m["content"] if isinstance(p, dict))
    return job


def prepare(path: Path, tenant_id: str, batch_id: str) -> Prepared:
    """Parse and validate every line; bad lines are reported, not sent."""
    out = Prepared()
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SubmitError(f"cannot read {path}: {e}") from e
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            data = json.loads(text)
            if not isinstance(data, dict):
                raise ValueError("expected a JSON object per line")
            if "custom_id" in data and "body" in data:
                data = _from_openai(data)
            if data.get("tenant_id", tenant_id) != tenant_id:
                raise ValueError(f"tenant_id: {data['tenant_id']!r} differs from --tenant {tenant_id!r}; drop it or fix it")
            data["tenant_id"] = tenant_id
            data.setdefault("batch_id", batch_id)
            data.setdefault("request_id", f"{batch_id}-{n}")
            out.jobs.append(Job.model_validate(data))
        except json.JSONDecodeError as e:
            out.errors.append(f"line {n}: not valid JSON ({e.msg} at column {e.colno})")
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            more = f" (+{len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
            out.errors.append(f"line {n}: {where + ': ' if where else ''}{first['msg'].removeprefix('Value error, ')}{more}")
        except ValueError as e:
            out.errors.append(f"line {n}: {e}")
    seen: set[str] = set()
    for job in out.jobs:
        if job.request_id in seen:
            out.errors.append(f"request_id {job.request_id!r} appears twice; request ids are unique per tenant")
        seen.add(job.request_id)
    if len(seen) != len(out.jobs):
        out.jobs = list({j.request_id: j for j in out.jobs}.values())
    return out


def partition_key(job: Job, by: str) -> bytes:
    """The record key of a job; `adapter-balanced` keys by adapter too (its partition is chosen, not hashed)."""
    by = "adapter" if by == "adapter-balanced" else by
    value = {"tenant": job.tenant_id, "adapter": f"{job.tenant_id}/{job.adapter or ''}", "request": job.request_id}[by]
    return value.encode()


def job_weight(job: Job) -> int:
    """A job's expected GPU work in tokens: its prompt ids (if given as ids) and its new tokens; decode dominates."""
    return len(job.input_ids or ()) + job.max_new_tokens + 1


def balanced_partitions(jobs: list[Job], partitions: list[int]) -> list[int]:
    """A partition for each job of a batch: jobs of one adapter together, partitions loaded evenly.

    Keyed by adapter and hashed, a zipf batch lands unevenly: in the scale-out bench's 2,000 jobs over 64
    adapters, one adapter has 20% of the jobs and the hash put 68% of all jobs on one of two workers, which
    then ran alone for half the batch (engine/PERF.md, issue 7). Here each adapter's jobs form a group weighed
    by `job_weight`; a group heavier than a partition's fair share (total / partitions) is cut into that many
    shares' worth of consecutive jobs (a hot adapter is then loaded on a few workers instead of overloading
    one); groups are then placed heaviest first on the least-loaded partition (LPT), which keeps every
    partition within the largest group's weight of the mean, and in practice much closer.
    """
    assert partitions, "a topic has at least one partition"
    weights = [job_weight(j) for j in jobs]
    fair = sum(weights) / len(partitions)
    by_key: dict[bytes, list[int]] = {}
    for i, job in enumerate(jobs):
        by_key.setdefault(partition_key(job, "adapter"), []).append(i)
    groups: list[tuple[int, list[int]]] = []  # (weight, job indices)
    for idx in by_key.values():
        total = sum(weights[i] for i in idx)
        pieces = max(1, min(len(idx), math.ceil(total / fair - 1e-9))) if fair > 0 else 1
        for k in range(pieces):
            part = idx[k * len(idx) // pieces : (k + 1) * len(idx) // pieces]
            groups.append((sum(weights[i] for i in part), part))
    groups.sort(key=lambda g: -g[0])
    heap = [(0, p) for p in sorted(partitions)]
    out = [0] * len(jobs)
    for weight, part in groups:
        load, p = heapq.heappop(heap)
        for i in part:
            out[i] = p
        heapq.heappush(heap, (load + weight, p))
    return out


async def produce_jobs(cfg: KafkaConfig, jobs: list[Job], batch_id: str, tenant_id: str, source: str, key_by: str,
                       progress=None) -> None:
    producer = make_producer(cfg, client_id="lorabatch-submit")
    await producer.start()
    try:
        placed: list[int | None] = [None] * len(jobs)
        if key_by == "adapter-balanced" and jobs:
            placed = balanced_partitions(jobs, sorted(await producer.partitions_for(cfg.jobs_topic)))
        futures = []
        for job, partition in zip(jobs, placed):
            futures.append(await producer.send(cfg.jobs_topic, job.model_dump_json(exclude_none=True).encode(),
                                               key=partition_key(job, key_by), partition=partition))
            if progress is not None:
                progress(1)
        await asyncio.gather(*futures)
        manifest = BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=[j.request_id for j in jobs],
                                 source=source, created_at=datetime.now(UTC).isoformat())
        await producer.send_and_wait(cfg.batches_topic, manifest.model_dump_json().encode(), key=batch_id.encode())
    finally:
        await producer.stop()


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:16]


async def _read_topics(cfg: KafkaConfig, handlers: dict, until_end: bool, stop, timeout_s: float) -> None:
    """Read whole topics from the beginning without a group, handing each message to its topic's handler."""
    consumer = make_consumer(cfg, group_id=None, client_id="lorabatch-results")
    await consumer.start()
    try:
        tps = [TopicPartition(t, p) for t in handlers for p in sorted(consumer.partitions_for_topic(t) or ())]
        if not tps:
            return
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        # Tansu answers ListOffsets with the last batch's base offset + 1, so reaching "the end" is
        # judged by that offset *and* a poll that brings nothing more.
        end = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            batches = await consumer.getmany(*tps, timeout_ms=200)
            for tp, messages in batches.items():
                for m in messages:
                    handlers[tp.topic](m.key, m.value)
            if stop():
                return
            if until_end and not batches:
                positions = [await consumer.position(tp) for tp in tps]
                if all(pos >= end[tp] for pos, tp in zip(positions, tps)):
                    return
    finally:
        await consumer.stop()


async def read_manifest(cfg: KafkaConfig, batch_id: str, timeout_s: float = 10.0) -> BatchManifest | None:
    found: list[BatchManifest] = []

    def take(key, value):
        if key == batch_id.encode():
            found.append(BatchManifest.model_validate_json(value))

    await _read_topics(cfg, {cfg.batches_topic: take}, True, lambda: False, timeout_s)
    if not found:
        return None
    merged = found[0]
    for later in found[1:]:  # the same batch id submitted again adds its new request ids
        ids = merged.request_ids + [r for r in later.request_ids if r not in set(merged.request_ids)]
        merged = merged.model_copy(update={"request_ids": ids})
    return merged


async def collect_results(cfg: KafkaConfig, manifest: BatchManifest, timeout_s: float, progress=None) -> tuple[dict[str, Result], dict[str, DlqRecord]]:
    """Results (first one per request id) and DLQ records of the batch, until all are in or the time is up."""
    wanted = set(manifest.request_ids)
    results: dict[str, Result] = {}
    dlq: dict[str, DlqRecord] = {}

    def take_result(key, value):
        r = Result.model_validate_json(value)
        if r.batch_id == manifest.batch_id and r.request_id in wanted and r.request_id not in results:
            results[r.request_id] = r
            if progress is not None and r.request_id not in dlq:
                progress(1)

    def take_dlq(key, value):
        d = DlqRecord.model_validate_json(value)
        if d.batch_id == manifest.batch_id and d.request_id in wanted and d.request_id not in dlq:
            dlq[d.request_id] = d
            if progress is not None and d.request_id not in results:
                progress(1)

    def complete() -> bool:
        return len(wanted - results.keys() - dlq.keys()) == 0

    await _read_topics(cfg, {cfg.results_topic: take_result, cfg.dlq_topic: take_dlq}, False, complete, timeout_s)
    return results, dlq


def to_openai_line(result: Result) -> dict:
    """One line of the OpenAI Batch API output file."""
    if result.status == "failed":
        assert result.error is not None
        return {"id": f"batch_req_{result.request_id}", "custom_id": result.request_id, "response": None,
                "error": {"code": result.error.code, "message": result.error.message}}
    body = {
        "id": f"cmpl-{result.request_id}", "object": "text_completion", "model": result.adapter or "base",
        "choices": [{"index": 0, "text": result.text, "finish_reason": "stop" if result.finish_reason == "eos" else result.finish_reason,
                     "logprobs": result.logprobs}],
        "usage": {"prompt_tokens": result.usage.input_tokens, "completion_tokens": result.usage.output_tokens,
                  "total_tokens": result.usage.input_tokens + result.usage.output_tokens,
                  "prompt_tokens_details": {"cached_tokens": result.usage.cached_tokens}},
    }
    return {"id": f"batch_req_{result.request_id}", "custom_id": result.request_id,
            "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}
