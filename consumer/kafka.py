"""Kafka clients built from the configuration, the same way everywhere."""

from __future__ import annotations

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

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
        max_request_size=max(cfg.max_message_bytes, 1_048_576),
        linger_ms=5,
    )


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
