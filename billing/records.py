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
    created_at: datetime  # timezone-aware UTC: when its GPU work finished (its result reached the worker); decides its month and prices
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
    result_json: str | None = None  # the published result body (JSON text), returned to a resubmission
    gpu_kind: str | None = None  # price-list key of the GPU that ran it (the worker's LedgerConfig.gpu_kind); None: not known
    # The tenant's tier when it ran (its tokens' price list); None: not known (an unregistered tenant, an older writer),
    # priced at the tenant's tier at invoice time.
    tier: str | None = None


@dataclass(frozen=True)
class AnsweredRow:
    """What the ledger holds of a request that already ran: enough to answer its resubmission without running it.

    result_json is None for rows written before the ledger stored result bodies.
    """

    result_json: str | None
    status: str  # "succeeded" | "failed"
    error_code: str | None
    adapter: str | None  # resolved "name@version", None for the base model
    batch_id: str | None
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    base_us: int
    lora_us: int
    routing_us: int
    kv_saved_us: int
    worker_id: str


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
    gpu_kind: str | None = None  # price-list key of the GPU it was loaded onto (the worker's LedgerConfig.gpu_kind)


@dataclass(frozen=True)
class BusyRecord:
    """GPU busy time of one worker over one engine batch (or one flush interval).

    busy_us is the sum of the measured times of the `steps` engine steps run between started_at and
    ended_at: exactly what the engine split over those steps' requests as base_us + lora_us, so the
    ledger can check per-period conservation, and ended_at - started_at - busy_us is the GPU's idle time.

    unbilled_us names the part of the worker's busy time (this record's or an earlier one's) that requests took
    which no usage row bills, as the worker learned of it by ended_at: the requests an engine process was running
    when it died (answered engine_failed, with no time charged) and jobs abandoned when their partition was
    revoked (the new owner runs and bills them again).

    carried_us, on the last record of started_at's month (one whose ended_at is in a later month), is the busy time the
    worker measured in that month (this record's and its earlier ones') that no row of the month bills: requests still
    running at ended_at, and those that finished between the month's end and ended_at. Their rows are stamped when they
    finish, in ended_at's month or later, so reconcile moves that time to ended_at's month.
    """

    worker_id: str
    gpu_kind: str  # price-list key of the GPU, e.g. "h100-80g" (LedgerConfig.gpu_kind of the worker)
    started_at: datetime  # timezone-aware; with worker_id, the record's idempotency key
    ended_at: datetime  # timezone-aware, not before started_at
    busy_us: int  # sum of the steps' measured device time, integer microseconds
    steps: int  # engine steps measured
    unbilled_us: int = 0  # measured busy time of requests no usage row bills (above)
    carried_us: int = 0  # the month's busy time that rows of a later month bill (above)
