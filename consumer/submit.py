"""`lorabatch submit` and `lorabatch results`: batch files in, results out, through Kafka.

Input lines are native jobs (the contract in schemas.py) or OpenAI Batch API lines
(`{"custom_id", "method", "url", "body": {"model", "prompt" | "messages", "max_tokens", ...}}`), where
`body.model` names the adapter. Each submission writes a manifest (tenant, batch id, request ids) to
the batches topic so that `results` knows when the batch is complete. Every message is checked against
`kafka.max_message_bytes` before anything is produced: a job over it is a rejected line, and a manifest
over it is written as several parts that `results` merges.

A batch is a tenant's: `results` finds the manifest by (tenant, batch id) and takes the results whose
(tenant, request id) the manifest lists, one per request id however often it was published. A batch
produced by another client, with no manifest, is found in the jobs topic itself: its jobs are the
records whose `tenant_id` and `batch_id` are the batch's (`manifest_from_jobs`).
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError
from pydantic import TypeAdapter, ValidationError

from consumer.config import KafkaConfig
from consumer.kafka import make_consumer, make_producer, record_size
from consumer.openai_batch import body_field, from_openai_line, index_parts, is_openai_line
from consumer.schemas import BatchManifest, DlqRecord, Ident, Job, OpenAIRequest, Result, TenantId, describe, error_field, load_json
from consumer.undecodable import undecodable

log = logging.getLogger("lorabatch.submit")


class SubmitError(Exception):
    retriable = False


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
    """Parse and validate every line; bad lines are reported, not sent.

    With `max_message_bytes` (kafka.max_message_bytes), a line whose job would be a Kafka message
    larger than that (keyed by `key_by`) is a bad line too.
    """
    check_ids(tenant_id, batch_id)
    out = Prepared()
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise SubmitError(f"cannot read {path}: {e}") from e
    first_line: dict[str, int] = {}  # request_id -> the line that gave it first
    for n, raw in enumerate(lines, start=1):
        request, names = None, {}  # names: job field -> the OpenAI line's field, for errors
        try:
            text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM (a Windows editor's, or a file's joined on) is no content
            if not text.strip():
                continue
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
            if max_message_bytes is not None and (size := record_size(*job_message(job, key_by))) > max_message_bytes:
                raise ValueError(f"the job is {size} bytes as a Kafka message, over kafka.max_message_bytes={max_message_bytes}; "
                                 f"shorten its prompt (workers dead-letter larger messages) or raise the limit")
            out.jobs.append(job)
            if request is not None:
                out.openai[job.request_id] = request
        except UnicodeDecodeError as e:
            out.errors.append(f"line {n}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); save the file as UTF-8")
        except json.JSONDecodeError as e:
            out.errors.append(f"line {n}: not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno}); {_json_fix(e.msg)}")
        except RecursionError:
            out.errors.append(f"line {n}: the JSON nests too deeply; send a flat job object (the README's \"Job and result contract\")")
        except ValidationError as e:
            errors = e.errors(include_url=False)
            where = body_field(error_field(errors[0]) or "", names) or None
            out.errors.append(f"line {n}: {describe(errors[0], len(errors), where).message}")
        except ValueError as e:
            out.errors.append(f"line {n}: {e}")
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


def manifest_parts(batch_id: str, tenant_id: str, request_ids: list[str], source: str, max_message_bytes: int) -> list[BatchManifest]:
    """The batch's manifest as messages of at most `max_message_bytes` each; `read_manifest` merges them.

    One part unless the ids do not fit: at the default 1,000,000-byte limit a part holds ~7,600 ids of
    the longest kind (128 characters), ~40,000 of the generated `batch_<16 hex>-<line>` kind.
    """
    created_at = datetime.now(UTC).isoformat(timespec="microseconds")
    empty = BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=[], source=source, created_at=created_at)
    budget = max_message_bytes - record_size(batch_id.encode(), empty.model_dump_json().encode())
    parts: list[list[str]] = [[]]
    used = 0
    for rid in request_ids:
        cost = len(json.dumps(rid)) + 1  # ASCII-escaped, so never shorter than pydantic's UTF-8; the comma
        if cost > budget:
            raise SubmitError(f"kafka.max_message_bytes={max_message_bytes} leaves no room in a batch manifest for request id {rid!r} "
                              f"(source {source!r}); raise the limit or shorten the source path and ids")
        if used + cost > budget:
            parts.append([])
            used = 0
        parts[-1].append(rid)
        used += cost
    return [empty.model_copy(update={"request_ids": ids}) for ids in parts]


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
                       progress=None, openai: dict[str, OpenAIRequest] | None = None, producer=None) -> None:
    """Produce the jobs, then the batch's manifest; nothing at all when a job is over kafka.max_message_bytes.

    `openai` (Prepared.openai) goes into manifest parts of its own, read back by `read_manifest`. `producer`, an
    AIOKafkaProducer already started (make_producer), is used and left running; by default one is started and stopped.
    """
    records = [job_message(job, key_by) for job in jobs]
    too_big = [(job.request_id, size) for job, record in zip(jobs, records) if (size := record_size(*record)) > cfg.max_message_bytes]
    if too_big:
        named = ", ".join(f"{rid!r} ({size} bytes)" for rid, size in too_big[:3])
        raise SubmitError(f"{len(too_big)} of {len(jobs)} jobs are over kafka.max_message_bytes={cfg.max_message_bytes} as Kafka messages: "
                          f"{named}{', ...' if len(too_big) > 3 else ''}; nothing was produced; shorten their prompts or raise the limit")
    manifests = manifest_parts(batch_id, tenant_id, [j.request_id for j in jobs], source, cfg.max_message_bytes)
    try:
        manifests += index_parts(batch_id, tenant_id, openai or {}, source, manifests[0].created_at, cfg.max_message_bytes)
    except ValueError as e:
        raise SubmitError(str(e)) from e
    own = producer is None
    producer = producer if producer is not None else make_producer(cfg, client_id="lorabatch-submit")
    try:
        if own:
            await producer.start()  # inside: a start that fails (broker down) still closes what it opened
        placed: list[int | None] = [None] * len(jobs)
        if key_by == "adapter-balanced" and jobs:
            placed = balanced_partitions(jobs, sorted(await producer.partitions_for(cfg.jobs_topic)))
        futures = []
        for (key, value), partition in zip(records, placed):
            futures.append(await producer.send(cfg.jobs_topic, value, key=key, partition=partition))
            if progress is not None:
                progress(1)
        await asyncio.gather(*futures)
        for manifest in manifests:  # one key, so one partition: the parts stay in order
            await producer.send_and_wait(cfg.batches_topic, manifest.model_dump_json().encode(), key=batch_id.encode())
    finally:
        if own:
            await producer.stop()


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:16]


STALL_S = 30.0  # a topic that sends nothing for this long while records are still ahead of the reader has stopped


async def _read_topics(cfg: KafkaConfig, handlers: dict, until_end: bool, stop, timeout_s: float,
                       started: asyncio.Event | None = None) -> None:  # fmt: skip
    """Read whole topics from the beginning without a group, handing each message to its topic's handler, until `stop()`
    or, once every record the topics held at the start has been read, at their end (`until_end`) or at `timeout_s`
    from the start. What the topics held is always read whole, however long it takes: cut at the timeout, a manifest
    read behind other batches' parts named a part of its batch (430,000 of a million request ids) as the whole of it.
    KafkaTimeoutError when the topics send nothing for STALL_S seconds with records still ahead. `started` is set once
    the consumer is assigned and about to read."""
    consumer = make_consumer(cfg, group_id=None, client_id="lorabatch-results")
    try:
        await consumer.start()  # inside: a start that fails (broker down) still closes what it opened
        tps = [TopicPartition(t, p) for t in handlers for p in sorted(consumer.partitions_for_topic(t) or ())]
        if not tps:
            return
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        if started is not None:
            started.set()
        # Tansu answers ListOffsets with the last batch's base offset + 1, so reaching "the end" is
        # judged by that offset *and* a poll that brings nothing more.
        end = await consumer.end_offsets(tps)
        deadline = time.monotonic() + timeout_s
        last_record = time.monotonic()
        while True:
            batches = await consumer.getmany(*tps, timeout_ms=200)
            for tp, messages in batches.items():
                for m in messages:
                    if (bad := undecodable(m)) is not None:
                        log.warning("skipping %s:%s@%s: %s", tp.topic, tp.partition, m.offset, bad.describe())
                        continue
                    try:
                        handlers[tp.topic](m.key, m.value)
                    except ValueError as e:  # pydantic's ValidationError too: someone else's record, not ours
                        log.warning("skipping %s:%s@%s, which is not a lorabatch record: %s", tp.topic, tp.partition,
                                    m.offset, str(e).splitlines()[0][:200])
            if stop():
                return
            now = time.monotonic()
            if batches:
                last_record = now
            if batches and now < deadline:
                continue
            behind = [(tp, pos) for tp in tps if (pos := await consumer.position(tp)) < end[tp]]
            if not behind and (now >= deadline or until_end):
                return
            if behind and now - last_record >= STALL_S:
                tp, pos = behind[0]
                raise KafkaTimeoutError(f"{tp.topic} partition {tp.partition} sent nothing for {STALL_S:.0f} s at offset {pos}, "
                                        f"before its end at {end[tp]}")
    finally:
        await consumer.stop()


async def read_manifest(cfg: KafkaConfig, tenant_id: str, batch_id: str, timeout_s: float = 10.0) -> BatchManifest | None:
    """The manifest of `tenant_id`'s batch `batch_id`: its parts and resubmissions merged, ids in first-seen order.

    Another tenant's batch of the same id is not this one.
    """
    found: list[BatchManifest] = []

    def take(key, value):
        if key == batch_id.encode():  # manifests are keyed by batch id alone: the tenant is in the value
            manifest = BatchManifest.model_validate_json(value)
            if manifest.tenant_id == tenant_id and manifest.batch_id == batch_id:
                found.append(manifest)

    await _read_topics(cfg, {cfg.batches_topic: take}, True, lambda: False, timeout_s)
    if not found:
        return None
    # The same batch id submitted again, or a manifest written in parts, adds its new request ids.
    ids = list(dict.fromkeys(rid for manifest in found for rid in manifest.request_ids))
    openai: dict[str, OpenAIRequest] = {}
    for manifest in found:  # the first submission's line of a request id is the one answered
        for rid, request in manifest.openai.items():
            openai.setdefault(rid, request)
    return found[0].model_copy(update={"request_ids": ids, "openai": openai})


async def manifest_from_jobs(cfg: KafkaConfig, tenant_id: str, batch_id: str, timeout_s: float = 60.0) -> BatchManifest | None:
    """The manifest of a batch that no `lorabatch submit` wrote one for (another client produced its jobs):
    the request ids of the jobs topic's records whose `tenant_id` and `batch_id` are the batch's, in the
    order read (partition by partition), each once. None when the jobs topic holds none of them (never
    produced, or gone with the topic's retention). Records that are not JSON objects are not anyone's."""
    ids: dict[str, None] = {}

    def take(key, value):
        try:
            job = json.loads(value)
        except (TypeError, UnicodeDecodeError, json.JSONDecodeError):
            return  # dead-lettered by the workers: its batch cannot be told
        if (isinstance(job, dict) and job.get("tenant_id") == tenant_id and job.get("batch_id") == batch_id
                and isinstance(job.get("request_id"), str)):
            ids[job["request_id"]] = None

    await _read_topics(cfg, {cfg.jobs_topic: take}, True, lambda: False, timeout_s)
    if not ids:
        return None
    return BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=list(ids), source=f"topic {cfg.jobs_topic}")


async def collect_results(cfg: KafkaConfig, manifest: BatchManifest, timeout_s: float, progress=None) -> tuple[dict[str, Result], dict[str, DlqRecord]]:
    """The batch's results and DLQ records by request id, until every request has one or the time is up.

    Only the manifest's tenant's records count. A result is the answer to its (tenant, request id)
    whatever batch it was published for (a resubmitted request is answered with its first result),
    and the first one read is kept: a replayed result is the same answer again. A DLQ record is of one
    message, so it must be of this batch.
    """
    tenant_id, wanted = manifest.tenant_id, set(manifest.request_ids)
    results: dict[str, Result] = {}
    dlq: dict[str, DlqRecord] = {}

    def take_result(key, value):
        r = Result.model_validate_json(value)
        if r.tenant_id == tenant_id and r.request_id in wanted and r.request_id not in results:
            results[r.request_id] = r
            if progress is not None and r.request_id not in dlq:
                progress(1)

    def take_dlq(key, value):
        d = DlqRecord.model_validate_json(value)
        if (d.tenant_id == tenant_id and d.batch_id == manifest.batch_id and d.request_id in wanted
                and d.request_id not in dlq):
            dlq[d.request_id] = d
            if progress is not None and d.request_id not in results:
                progress(1)

    def complete() -> bool:
        return len(wanted - results.keys() - dlq.keys()) == 0

    await _read_topics(cfg, {cfg.results_topic: take_result, cfg.dlq_topic: take_dlq}, False, complete, timeout_s)
    return results, dlq
