"""Plain records the ledger takes: it knows nothing of the engine or Kafka."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime


@dataclass(frozen=True)
class UsageRecord:
    """One request's measured usage. Times are integer microseconds of GPU time."""

    tenant_id: str
    request_id: str
    status: str  # "succeeded" | "failed"
    created_at: datetime  # timezone-aware UTC; decides the billing period
    adapter: str | None = None  # resolved "name@version", None for the base model
    adapter_sha256: str | None = None
    batch_id: str | None = None
    route_reason: str = ""
    error_code: str | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    base_us: int = 0
    lora_us: int = 0
    routing_us: int = 0  # the routing decision itself
    kv_saved_us: int = 0
    queue_us: int = 0
    ttft_us: int = 0
    total_us: int = 0
    worker_id: str = ""


@dataclass(frozen=True)
class AdapterLoadRecord:
    """One adapter load (a cold start): billed to the adapter's requests of the period."""

    adapter: str  # "name@version"
    adapter_sha256: str
    tenant_id: str  # owner of the adapter
    tier: str  # loaded from "disk" | "host"
    nbytes: int
    load_us: int
    worker_id: str
    created_at: datetime
