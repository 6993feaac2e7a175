"""Kafka clients built from the configuration, the same way everywhere.

Every client the project makes (producers, consumers, the admin client) takes its connection and
security options from `client_options`: the security protocol, the SASL mechanism and credentials, and a
TLS context built from the configured CA, certificate and key files.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import IllegalStateError
from aiokafka.helpers import create_ssl_context
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import OffsetAndMetadata

from consumer import undecodable
from consumer.config import KafkaConfig

log = logging.getLogger("lorabatch.worker")

# A producer's close first flushes what it holds, for as long as the broker takes to answer (a dead one: until each
# batch's 40 s request timeout). What the worker still needed sent was waited for before (Deliverer.drain).
PRODUCER_CLOSE_S = 5.0


def client_options(cfg: KafkaConfig) -> dict:
    """bootstrap_servers and the security keyword arguments of any aiokafka client."""
    opts: dict = {"bootstrap_servers": cfg.bootstrap_servers, "security_protocol": cfg.security_protocol}
    if cfg.security_protocol in ("SSL", "SASL_SSL"):
        opts["ssl_context"] = ssl_context(cfg)
    if cfg.security_protocol.startswith("SASL_"):
        assert cfg.sasl_username is not None and cfg.sasl_password is not None, "checked by KafkaConfig"
        opts.update(sasl_mechanism=cfg.sasl_mechanism, sasl_plain_username=cfg.sasl_username.get_secret_value(),
                    sasl_plain_password=cfg.sasl_password.get_secret_value())
    return opts


def ssl_context(cfg: KafkaConfig) -> ssl.SSLContext:
    """The TLS context for the brokers: the configured CA (or the system's), the client certificate if any."""
    context = create_ssl_context(cafile=cfg.ssl_cafile or None, certfile=cfg.ssl_certfile or None,
                                 keyfile=cfg.ssl_keyfile or None)
    context.check_hostname = cfg.ssl_check_hostname
    return context


def make_producer(cfg: KafkaConfig, client_id: str = "lorabatch") -> AIOKafkaProducer:
    # No idempotent producer: the embedded broker rejects InitProducerId, and redelivery is made
    # harmless by the ledger's (tenant, request_id) key instead.
    return AIOKafkaProducer(
        **client_options(cfg),
        client_id=client_id,
        acks="all",
        enable_idempotence=False,
        compression_type=None if cfg.compression_type == "none" else cfg.compression_type,
        # The configured limit itself: a record that the workers would dead-letter as too large is
        # refused here, at its producer, instead (record_size below is the size compared with it).
        max_request_size=cfg.max_message_bytes,
        # A partition's batch may grow to the same limit (a batch of small records is no larger on the broker than one
        # record of that size). At aiokafka's 16 KB, 1,024 results of 64 tokens took 3.4 tries each to find room in a
        # batch (a wait for the batch in flight to drain, then a retry), most of a result's producing CPU.
        max_batch_size=cfg.max_message_bytes,
        linger_ms=5,
    )


async def close_producer(producer: AIOKafkaProducer, timeout_s: float = PRODUCER_CLOSE_S) -> None:
    """Stop `producer` within `timeout_s`: with the broker away, its flush is given up and its connections closed (a
    worker stopped with the broker dead waited 30 s more here, past a 30 s grace period, after its summary line)."""
    try:
        await asyncio.wait_for(producer.stop(), timeout_s)
    except TimeoutError:
        log.warning("the producer could not flush within %.0f s (the broker does not answer); closing it without", timeout_s)
        # aiokafka 0.14: stop() cut in its flush skips these two; its sender then retried the dead broker for ever. The
        # connections go first: the sender's close waits for its requests in flight, which a frozen broker holds until
        # their 40 s request timeout (the worker's exit waited 30 s more here), and a closed connection fails them now.
        await producer.client.close()
        try:
            await asyncio.wait_for(producer._sender.close(), 1.0)
        except TimeoutError:  # requests to a frozen broker that reconnected: they end at their own request timeout
            log.warning("the producer's requests in flight are left to their 40 s request timeout (the broker does not "
                        "answer them)")


def record_size(key: bytes | None, value: bytes) -> int:
    """The size of one record (no headers) as the producer compares it with max_request_size.

    aiokafka's upper bound for a record alone in its batch: the value, the key and ~80 bytes of batch
    and record header. Callers check it against kafka.max_message_bytes before they produce anything.
    """
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])


def make_consumer(cfg: KafkaConfig, *topics: str, group_id: str | None, client_id: str = "lorabatch", **kw) -> AIOKafkaConsumer:
    """A consumer that commits by hand and hands out a record batch it cannot decode as one marker record
    at its offset (consumer/undecodable.py) instead of failing on it forever."""
    undecodable.install()
    fetch_bytes = max(cfg.max_message_bytes, 1_048_576)
    return AIOKafkaConsumer(
        *topics,
        **client_options(cfg),
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        # A producer's aborted transaction is no job: on Kafka, read_uncommitted (aiokafka's default) hands its records
        # out, and they would run and be billed. (The embedded Tansu broker keeps no transactions.)
        isolation_level="read_committed",
        value_deserializer=undecodable.KeepValue(fetch_bytes),
        session_timeout_ms=cfg.session_timeout_ms,
        heartbeat_interval_ms=cfg.heartbeat_interval_ms,
        fetch_max_bytes=max(cfg.max_message_bytes * 4, 4 * 1_048_576),
        max_partition_fetch_bytes=fetch_bytes,
        metadata_max_age_ms=cfg.metadata_max_age_ms,
        **{"fetch_max_wait_ms": cfg.fetch_max_wait_ms, **kw},
    )


def membership_lost(consumer: AIOKafkaConsumer) -> bool:
    """Whether the group coordinator no longer knows this consumer: its session expired (no heartbeat for
    kafka.session_timeout_ms: the process was frozen or starved) and its partitions went to other members. aiokafka 0.14
    then resets the member's generation (to OffsetCommitRequest.DEFAULT_GENERATION_ID, -1) before it rejoins and revokes
    what it held; a plain rebalance keeps it. The broker refuses a commit made then (UnknownMemberId)."""
    coordinator = getattr(consumer, "_coordinator", None)
    return coordinator is not None and coordinator.generation < 0


async def commit_in_generation(consumer: AIOKafkaConsumer, offsets: dict[TopicPartition, int]) -> bool:
    """Commit `offsets` (the next offset to read, by partition) once, under the group generation this member holds when
    the request is built; send nothing and return False while it holds none (`membership_lost`).

    aiokafka's `commit` is not used: it reads the generation only when it builds each request, after its own waits (the
    coordinator's lookup, its commit lock, a task of its own) and again on each of its retries. Offsets taken from marks
    of one generation then went out under another: with the generation reset to -1 (the group dropped this member; a
    memory-only broker restarted and forgot the group), a commit waiting behind the one that found it out was sent as a
    plain, unfenced commit (generation -1 is how a consumer outside group management commits) and the restarted broker,
    where the group did not exist yet, took it: the old log's {jobs:1: 3} landed on the new log, and the rejoined group
    read jobs:1 from 3, past three jobs never run. (On Kafka, too, a group with no member takes such a commit.) Here the
    generation is checked under the commit lock, with no await before the request is built, and a failure is not retried
    here: the worker's next commit (consumer/handover.py) recomputes its offsets from marks that the rejoin's revoke has
    dropped by then. What this leaves uncommitted is redelivered (at least once; the ledger's key bills it once)."""
    coordinator = consumer._coordinator
    await coordinator.ensure_coordinator_known()
    async with coordinator._commit_lock:
        subscription = consumer._subscription.subscription
        assignment = subscription.assignment if subscription is not None else None
        if membership_lost(consumer) or assignment is None:
            return False
        if unassigned := set(offsets) - assignment.tps:
            raise IllegalStateError(f"Partitions {sorted(unassigned)} are not assigned")
        await coordinator._do_commit_offsets(assignment, {tp: OffsetAndMetadata(o, "") for tp, o in offsets.items()})
    return True


async def group_members(cfg: KafkaConfig) -> str:
    """Who holds the workers' group, in a line for the log of a join that hangs: its state and members' ids (a worker's
    id leads its member id). A member whose worker is gone holds the group until its session times out; the embedded
    broker never expires one that left under static membership (`--worker-id`): a worker under another id then waited
    for ever, told only that a dead member holds the group "until its session times out"."""
    admin = AIOKafkaAdminClient(**client_options(cfg), request_timeout_ms=5000)
    await admin.start()
    try:
        [response] = await admin.describe_consumer_groups([cfg.group_id])
    finally:
        await admin.close()
    group = response.to_object()["groups"][0]
    members = sorted(m["member_id"] for m in group["members"])
    return (f"group {cfg.group_id} is {group['state']} with {len(members)} member(s): {', '.join(members) or 'none'}; "
            "a member named for a worker that is gone holds it until its session times out (on the embedded broker, "
            "one that left under --worker-id holds it until a worker with that id starts again: start one, or restart "
            "the broker)")
