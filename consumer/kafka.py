"""Kafka clients built from the configuration, the same way everywhere."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from consumer.config import KafkaConfig


def make_producer(cfg: KafkaConfig, client_id: str = "lorabatch") -> AIOKafkaProducer:
    # No idempotent producer: the embedded broker rejects InitProducerId, and redelivery is made
    # harmless by the ledger's (tenant, request_id) key instead.
    return AIOKafkaProducer(
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=client_id,
        acks="all",
        enable_idempotence=False,
        compression_type=None if cfg.compression == "none" else cfg.compression,
        # The configured limit itself: a record that the workers would dead-letter as too large is
        # refused here, at its producer, instead (record_size below is the size compared with it).
        max_request_size=cfg.max_message_bytes,
        linger_ms=5,
    )


def record_size(key: bytes | None, value: bytes) -> int:
    """The size of one record (no headers) as the producer compares it with max_request_size.

    aiokafka's upper bound for a record alone in its batch: the value, the key and ~80 bytes of batch
    and record header. Callers check it against kafka.max_message_bytes before they produce anything.
    """
    return DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, [])


def make_consumer(cfg: KafkaConfig, *topics: str, group_id: str | None, client_id: str = "lorabatch", **kw) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        *topics,
        bootstrap_servers=cfg.bootstrap_servers,
        client_id=client_id,
        group_id=group_id,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_bytes=max(cfg.max_message_bytes * 4, 4 * 1_048_576),
        max_partition_fetch_bytes=max(cfg.max_message_bytes, 1_048_576),
        **kw,
    )
