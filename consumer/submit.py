"""`lorabatch submit` and `lorabatch results`: batch files in, results out, through Kafka.

A file's lines (native jobs or OpenAI Batch API lines, read and checked by batch_file.py) are produced as they are
read, a chunk at a time; each chunk is followed by the manifest parts (tenant, batch id, request ids) that name its
jobs on the batches topic, so that `results` knows when the batch is complete. Every message is checked against
`kafka.max_message_bytes` before it is produced: a job over it is a rejected line, and a manifest over it is written
as several parts that `results` merges.

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
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime

from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError

from consumer.config import KafkaConfig
from consumer.kafka import make_consumer, make_producer, record_size
from consumer.batch_file import Line, SubmitError, job_message, partition_key
from consumer.openai_batch import index_parts
from consumer.schemas import BatchManifest, DlqRecord, Job, OpenAIRequest, Result, parse_job
from consumer.undecodable import undecodable

log = logging.getLogger("lorabatch.submit")


def manifest_parts(batch_id: str, tenant_id: str, request_ids: list[str], source: str, max_message_bytes: int,
                   created_at: str | None = None, digests: dict[str, str] | None = None) -> list[BatchManifest]:
    """The batch's manifest as messages of at most `max_message_bytes` each; `read_manifest` merges them.

    One part unless the ids do not fit: at the default 1,000,000-byte limit a part holds ~7,600 ids of
    the longest kind (128 characters), ~40,000 of the generated `batch_<16 hex>-<line>` kind (about half as many
    with `digests`, request id -> job_digest, which go in the part that names the id).
    """
    created_at = created_at or _now()  # every part of a batch (of each chunk of a file) carries the first one's time
    empty = BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=[], source=source, created_at=created_at)
    budget = max_message_bytes - record_size(batch_id.encode(), empty.model_dump_json().encode())
    digests = digests or {}
    parts: list[list[str]] = [[]]
    used = 0
    for rid in request_ids:
        cost = len(json.dumps(rid)) + 1  # ASCII-escaped, so never shorter than pydantic's UTF-8; the comma
        if rid in digests:
            cost += len(json.dumps(rid)) + len(json.dumps(digests[rid])) + 2  # "rid":"digest",
        if cost > budget:
            raise SubmitError(f"kafka.max_message_bytes={max_message_bytes} leaves no room in a batch manifest for request id {rid!r} "
                              f"(source {source!r}); raise the limit or shorten the source path and ids")
        if used + cost > budget:
            parts.append([])
            used = 0
        parts[-1].append(rid)
        used += cost
    return [empty.model_copy(update={"request_ids": ids, "digests": {rid: digests[rid] for rid in ids if rid in digests}})
            for ids in parts]


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


MANIFEST_EVERY = 5_000  # jobs of a file produced before the manifest parts that name them: what submit holds at once,
CHUNK_BYTES = 64 << 20  # or fewer, once their lines are this many bytes of the file (5,000 prompts of 1 MB were 10 GB)


async def produce_jobs(cfg: KafkaConfig, jobs: list[Job], batch_id: str, tenant_id: str, source: str, key_by: str,
                       progress=None, openai: dict[str, OpenAIRequest] | None = None, producer=None) -> None:
    """Produce the jobs, then the batch's manifest; nothing at all when a job is over kafka.max_message_bytes.

    `openai` (Prepared.openai) goes into manifest parts of its own, read back by `read_manifest`. `producer`, an
    AIOKafkaProducer already started (make_producer), is used and left running; by default one is started and stopped.
    """
    records = _sized_records(cfg, jobs, [job_message(job, key_by) for job in jobs])
    manifests = _manifests(cfg, jobs, batch_id, tenant_id, source, openai or {}, _now())
    own = producer is None
    producer = producer if producer is not None else make_producer(cfg, client_id="lorabatch-submit")
    try:
        if own:
            await producer.start()  # inside: a start that fails (broker down) still closes what it opened
        await _send(producer, cfg, jobs, records, manifests, key_by, progress)
    finally:
        if own:
            await producer.stop()


async def produce_lines(cfg: KafkaConfig, lines: Iterable[Line], batch_id: str, tenant_id: str, source: str, key_by: str,
                        sent=None) -> int:
    """Produce the good lines' jobs while the file is read (`read_lines`), MANIFEST_EVERY (or CHUNK_BYTES of lines) at a
    time: a chunk's jobs, then, once the broker has them all, the manifest parts that name them. Returns how many were
    produced; `sent(n)` is told the count so far after each chunk.

    A file's jobs are never all in memory (a million lines took 2.4 GB read whole), except under `adapter-balanced`,
    which places a batch's jobs by all of their weights and reads the file into one chunk. The submission is opened and
    closed by manifest parts of its own (`_mark`): one cut short (the broker failed, ^C) has the manifests of the chunks
    it produced and stays open, which `results` tells; the same file submitted again under the same batch id adds the
    rest, closes it, and runs nothing twice. No producer is started for a file without a good line.
    """
    created_at = _now()
    producer = None
    total = 0
    try:
        whole = key_by == "adapter-balanced"
        for chunk in _chunks((line for line in lines if line.job is not None), None if whole else MANIFEST_EVERY,
                             None if whole else CHUNK_BYTES):
            jobs = [line.job for line in chunk]
            records = _sized_records(cfg, jobs, [line.record or job_message(line.job, key_by) for line in chunk])
            openai = {line.job.request_id: line.request for line in chunk if line.request is not None}
            digests = {line.job.request_id: line.digest for line in chunk if line.digest is not None}
            manifests = _manifests(cfg, jobs, batch_id, tenant_id, source, openai, created_at, digests)
            if producer is None:
                producer = make_producer(cfg, client_id="lorabatch-submit")
                await producer.start()  # inside: a start that fails (broker down) still closes what it opened
                await _mark(producer, cfg, batch_id, tenant_id, source, created_at, complete=False)
            await _send(producer, cfg, jobs, records, manifests, key_by, None)
            total += len(chunk)
            if sent is not None:
                sent(total)
        if producer is not None:
            await _mark(producer, cfg, batch_id, tenant_id, source, created_at, complete=True)
    finally:
        if producer is not None:
            await producer.stop()
    return total


async def _mark(producer, cfg: KafkaConfig, batch_id: str, tenant_id: str, source: str, created_at: str, *, complete: bool) -> None:
    """The manifest part that opens (False) or closes (True) a submission of a file produced as it is read: `results`
    of a batch whose last submission is still open says so (still running, or cut short), not that it is complete."""
    mark = BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=[], source=source, created_at=created_at, complete=complete)
    await producer.send_and_wait(cfg.batches_topic, mark.model_dump_json().encode(), key=batch_id.encode())


def _chunks(lines: Iterable[Line], size: int | None, max_bytes: int | None) -> Iterator[list[Line]]:
    """`lines` in lists of `size`, or fewer where their lines reach `max_bytes` of the file (None: no bound)."""
    chunk: list[Line] = []
    held = 0
    for line in lines:
        chunk.append(line)
        held += line.size
        if (size is not None and len(chunk) >= size) or (max_bytes is not None and held >= max_bytes):
            yield chunk
            chunk, held = [], 0
    if chunk:
        yield chunk


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def _sized_records(cfg: KafkaConfig, jobs: list[Job], records: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """`records`, or SubmitError naming the jobs over kafka.max_message_bytes (and nothing is produced)."""
    too_big = [(job.request_id, size) for job, record in zip(jobs, records) if (size := record_size(*record)) > cfg.max_message_bytes]
    if too_big:
        named = ", ".join(f"{rid!r} ({size} bytes)" for rid, size in too_big[:3])
        raise SubmitError(f"{len(too_big)} of {len(jobs)} jobs are over kafka.max_message_bytes={cfg.max_message_bytes} as Kafka messages: "
                          f"{named}{', ...' if len(too_big) > 3 else ''}; nothing was produced; shorten their prompts or raise the limit")
    return records


def _manifests(cfg: KafkaConfig, jobs: list[Job], batch_id: str, tenant_id: str, source: str, openai: dict[str, OpenAIRequest],
               created_at: str, digests: dict[str, str] | None = None) -> list[BatchManifest]:
    manifests = manifest_parts(batch_id, tenant_id, [j.request_id for j in jobs], source, cfg.max_message_bytes, created_at,
                               digests)
    try:
        return manifests + index_parts(batch_id, tenant_id, openai, source, created_at, cfg.max_message_bytes)
    except ValueError as e:
        raise SubmitError(str(e)) from e


async def _send(producer, cfg: KafkaConfig, jobs: list[Job], records: list[tuple[bytes, bytes]], manifests: list[BatchManifest],
                key_by: str, progress) -> None:
    """The jobs' records, then (once the broker has them all) the manifest parts that name them."""
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
        await producer.send_and_wait(cfg.batches_topic, manifest.model_dump_json().encode(), key=manifests[0].batch_id.encode())


def retried(result: Result) -> bool:
    """A failure the workers do not keep as the request's answer: the request sent again is run again."""
    return result.status == "failed" and result.error is not None and result.error.retriable


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:16]


STALL_S = 30.0  # a topic that sends nothing for this long while records are still ahead of the reader has stopped


async def _read_topics(cfg: KafkaConfig, handlers: dict, until_end: bool, stop, timeout_s: float,
                       started: asyncio.Event | None = None, caught_up=None) -> None:  # fmt: skip
    """Read whole topics from the beginning without a group, handing each message to its topic's handler, until `stop()`
    or, once every record the topics held at the start has been read, at their end (`until_end`) or at `timeout_s`
    from the start. What the topics held is always read whole, however long it takes: cut at the timeout, a manifest
    read behind other batches' parts named a part of its batch (430,000 of a million request ids) as the whole of it.
    KafkaTimeoutError when the topics send nothing for STALL_S seconds with records still ahead. `started` is set once
    the consumer is assigned and about to read; `caught_up()` is called once every record the topics held at the start
    has been read (before `stop()` is asked)."""
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
            if caught_up is not None and all([await consumer.position(tp) >= end[tp] for tp in tps]):
                caught_up()
                caught_up = None
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
    digests: dict[str, str] = {}
    for manifest in found:  # the first submission's line of a request id is the one answered
        for rid, request in manifest.openai.items():
            openai.setdefault(rid, request)
        for rid, digest in manifest.digests.items():
            digests.setdefault(rid, digest)
    complete = next((m.complete for m in reversed(found) if m.complete is not None), True)
    return found[0].model_copy(update={"request_ids": ids, "openai": openai, "complete": complete, "digests": digests})


async def manifest_from_jobs(cfg: KafkaConfig, tenant_id: str, batch_id: str, timeout_s: float = 60.0) -> BatchManifest | None:
    """The manifest of a batch that no `lorabatch submit` wrote one for (another client produced its jobs):
    the request ids of the jobs topic's records whose `tenant_id` and `batch_id` are the batch's, in the
    order read (partition by partition), each once. None when the jobs topic holds none of them (never
    produced, or gone with the topic's retention). A record is read as the workers read it (`parse_job`), so that
    every id taken is one they answer under it, with a result or a DLQ record that names it: a record they cannot
    read an identity from (not UTF-8 JSON, nested too deeply, its request_id given twice) is dead-lettered under no
    request id, and waiting for one kept `results` to its timeout."""
    ids: dict[str, None] = {}

    def take(key, value):
        job = parse_job(value)
        if job.tenant_id == tenant_id and job.batch_id == batch_id and job.request_id is not None:
            ids[job.request_id] = None

    await _read_topics(cfg, {cfg.jobs_topic: take}, True, lambda: False, timeout_s)
    if not ids:
        return None
    return BatchManifest(batch_id=batch_id, tenant_id=tenant_id, request_ids=list(ids), source=f"topic {cfg.jobs_topic}")


async def collect_results(cfg: KafkaConfig, manifest: BatchManifest, timeout_s: float, progress=None,
                          contested: set[str] | None = None) -> tuple[dict[str, Result], dict[str, DlqRecord]]:
    """The batch's results and DLQ records by request id, until every request has one or the time is up.

    Only the manifest's tenant's records count. A result is the answer to its (tenant, request id)
    whatever batch it was published for (a resubmitted request is answered with its first result),
    and the first one read is kept: a replayed result is the same answer again. A copy that differs from the one kept
    (two workers ran the request at once; the ledger billed one of them: consumer.billed) adds its request id to
    `contested`, where given. A failure the result calls retriable
    (quota_exceeded under on_quota=fail, engine_error, ...) is not kept by the workers, so the request sent again runs
    again: a later result of it is the answer, and what the topics held at the start is read whole before such a
    failure is taken as the last word, or a DLQ record (a request can have both: a result too large to publish goes out
    as a small failed result and a DLQ record; the result is its answer). A DLQ record is of one message, so it must be
    of this batch.
    """
    tenant_id, wanted = manifest.tenant_id, set(manifest.request_ids)
    results: dict[str, Result] = {}
    dlq: dict[str, DlqRecord] = {}

    read_whole = [False]  # every record there at the start has been read

    def take_result(key, value):
        r = Result.model_validate_json(value)
        if r.tenant_id != tenant_id or r.request_id not in wanted:
            return
        if (held := results.get(r.request_id)) is not None:
            if retried(held):  # the request was sent again and answered again
                results[r.request_id] = r
            elif contested is not None and not retried(r) and r != held:
                contested.add(r.request_id)
            return
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
        # A DLQ record alone is not the last word either: a result too large for the broker goes out as a small failed
        # result and a DLQ record, and whichever topic a fetch brought first decided what `results` wrote.
        settled = read_whole[0] or not (any(map(retried, results.values())) or dlq.keys() - results.keys())
        return len(wanted - results.keys() - dlq.keys()) == 0 and settled

    def caught_up() -> None:
        read_whole[0] = True

    await _read_topics(cfg, {cfg.results_topic: take_result, cfg.dlq_topic: take_dlq}, False, complete, timeout_s,
                       caught_up=caught_up)
    return results, dlq
