"""The engine's public types: what callers hand in and what comes back.

The consumer talks to the engine only through these and `Engine`'s methods; nothing here knows of
Kafka, Redis or SQL. Times are integer microseconds so that the shares of one step add up to the
measured step time exactly (billing converts to milliseconds at the edge).

A request's identity is (tenant_id, request_id): two tenants may use the same request_id at the same time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# Error codes that mean the adapter itself is at fault (its files cannot be read, are corrupt, unsafe, too large,
# changed since registration, do not fit the base, or loading them raised): the ones a caller should count toward
# an adapter's circuit breaker. Not in it: unknown_adapter (the key was never registered: the caller's mistake),
# adapter_in_use / adapter_key_in_use / invalid_slo_tier (calls made wrongly), and every request or engine code.
ADAPTER_ERROR_CODES = frozenset({
    "adapter_invalid",  # engine.adapters: the config or weights are not a valid PEFT LoRA adapter
    "adapter_corrupt",  # engine.adapters / engine.store: unreadable JSON or safetensors
    "adapter_base_mismatch",  # engine.adapters: shapes or base fingerprint of another model
    "adapter_rank_too_large",  # engine.adapters: rank over engine.max_lora_rank
    "adapter_missing",  # engine.store: the folder or a file is missing
    "adapter_unsafe",  # engine.store: a path escapes the store, a link, not a regular file
    "adapter_too_large",  # engine.store: over engine.max_adapter_bytes
    "adapter_unavailable",  # engine.adapter_pool: reading the files failed (OSError; retriable)
    "adapter_changed",  # engine.adapter_pool: the files no longer hash to the registered sha256
    "adapter_load_failed",  # engine.planner: loading it raised an unexpected error
})  # fmt: skip

FinishReason = Literal["stop", "length", "eos"]


class EngineError(Exception):
    """An operational failure of the engine, with a stable `code` and a message that says how to fix it."""

    code = "engine_error"
    retriable = False

    def __init__(self, message: str, *, code: str | None = None, retriable: bool | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code
        if retriable is not None:
            self.retriable = retriable

    @property
    def message(self) -> str:
        return str(self)


class AdapterError(EngineError):
    """An adapter cannot be loaded or does not fit the base model."""

    code = "adapter_invalid"


class RequestError(EngineError):
    """A request is malformed for this engine (prompt too long, unknown adapter, ...)."""

    code = "invalid_request"


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # top-k log-probabilities per generated token, as OpenAI returns them
    ignore_eos: bool = False


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    # Exactly one of prompt / messages / input_ids.
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    input_ids: tuple[int, ...] | None = None
    adapter_key: str | None = None  # key of a registered adapter (Engine.register_adapter / load_adapter), None: the base model
    sampling: SamplingParams = field(default_factory=SamplingParams)
    priority: int = 0  # higher runs first; under KV pressure the lowest priority running request is preempted
    tenant_id: str = ""  # for KV isolation and quotas; the engine attaches no other meaning to it
    arrival_us: int | None = None  # monotonic clock (time.monotonic_ns() // 1000) when the job arrived
    # When the adapter cannot be loaded (missing, corrupt, refused by validation), run on the base model
    # instead of failing; the result says so with base_fallback=True.
    allow_base_fallback: bool = False


@dataclass
class RequestTimings:
    """Measured per request, in integer microseconds; a step's shares sum to the step's time exactly."""

    base_us: int = 0  # share of the base model's compute in the steps this request took part in
    lora_us: int = 0  # share of the LoRA compute of those steps
    kv_saved_us: int = 0  # prefill time the cached prefix tokens saved (a credit)
    adapter_load_us: int = 0  # time spent loading this request's adapter for it (cold start), if any
    queue_us: int = 0  # arrival to first scheduled step
    ttft_us: int = 0  # arrival to first generated token
    total_us: int = 0  # arrival to finish
    prefill_tokens: int = 0
    cached_tokens: int = 0
    decode_tokens: int = 0  # generated tokens fed back (recomputed ones after a preemption included)
    steps: int = 0
    preemptions: int = 0  # times its KV was freed under memory pressure and recomputed later


@dataclass
class GenerationResult:
    request_id: str
    adapter_key: str | None  # the request's adapter_key (None after a fallback to the base model)
    tenant_id: str = ""  # the request's, so that (tenant_id, request_id) routes the result
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    logprobs: dict | None = None  # {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}
    timings: RequestTimings = field(default_factory=RequestTimings)
    error: EngineError | None = None
    base_fallback: bool = False  # the adapter failed to load and the request ran on the base model (adapter_key is None)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class AdapterInfo:
    key: str  # the name the caller loaded it under, e.g. "tenant/name@3"
    sha256: str  # of the adapter's content (config + weights), the identity used for dedupe and KV keys
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    nbytes: int
    load_us: int  # measured load time
    tier: str  # where it was loaded from: "disk" (L3), "host" (L2) or "gpu" (already resident)
    dest: str = "gpu"  # where it went: "gpu" (an L1 slot) or "host" (L2 only)
    reason: str = "load_adapter"  # "load_adapter" (eager), "request" (a request waited for it) or "warm_pool"
    tenant: str = ""
    error_code: str | None = None  # set on a failed load: the code its requests failed with
    skip_reason: str | None = None  # why nothing was read, e.g. "duplicate_content" (seed 002, incident 5)
