"""The job and result contract (DESIGN.md, "Job and result contract"), versioned with `v`.

A message that is not a JSON object, or lacks a usable `request_id` / `tenant_id`, cannot be answered
and goes to the DLQ. Any other invalid field gets a `failed` result that names the field and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

CONTRACT_VERSION = 1

Ident = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@/\-]+$")]
TenantId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
AdapterRef = Annotated[str, StringConstraints(min_length=1, max_length=160, pattern=r"^[A-Za-z0-9_.\-/]+(@[0-9]+)?$")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class Job(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = CONTRACT_VERSION
    request_id: Ident
    tenant_id: TenantId
    batch_id: Ident | None = None
    adapter: AdapterRef | None = Field(None, description="name or name@version; absent: route it")
    user_id: Ident | None = None
    session_id: Ident | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[Annotated[int, Field(ge=0)]] | None = None
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: list[Annotated[str, StringConstraints(min_length=1, max_length=64)]] = Field(default_factory=list, max_length=8)
    priority: int = Field(0, ge=-100, le=100)
    allow_base_fallback: bool = False
    on_quota: Literal["wait", "fail"] = Field("wait", description="over the tenant's rate limit: wait, or fail with quota_exceeded")
    logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _one_input(self) -> "Job":
        given = [k for k in ("prompt", "messages", "input_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"give exactly one of prompt, messages or input_ids (got {', '.join(given) or 'none'})"
            )
        if self.prompt is not None and not self.prompt:
            raise ValueError("prompt is empty; send at least one character")
        if self.messages is not None and not self.messages:
            raise ValueError("messages is empty; send at least one message")
        if self.input_ids is not None and not self.input_ids:
            raise ValueError("input_ids is empty; send at least one token id")
        return self


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class Cost(BaseModel):
    """The four components in GPU milliseconds (DESIGN.md, "Cost attribution")."""

    base_ms: float = 0.0
    routing_ms: float = 0.0
    kv_saved_ms: float = 0.0
    cold_start_ms: float = 0.0


class Timings(BaseModel):
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


class ErrorInfo(BaseModel):
    code: str
    message: str
    field: str | None = None
    retriable: bool = False


class Result(BaseModel):
    v: Literal[1] = CONTRACT_VERSION
    request_id: str
    tenant_id: str
    batch_id: str | None = None
    adapter: str | None = None
    status: Literal["succeeded", "failed"]
    text: str = ""
    output_ids: list[int] = Field(default_factory=list)
    finish_reason: Literal["stop", "length", "eos"] | None = None
    logprobs: dict | None = None
    usage: Usage = Usage()
    cost: Cost = Cost()
    timings: Timings = Timings()
    route: str = ""
    error: ErrorInfo | None = None
    worker_id: str = ""


class DlqRecord(BaseModel):
    """An unanswerable message, kept whole with why and where it came from."""

    error: ErrorInfo
    source_topic: str
    source_partition: int
    source_offset: int
    source_timestamp_ms: int | None = None
    raw: str  # the message value, decoded as UTF-8 with replacement; raw_b64 holds the exact bytes
    raw_b64: str
    request_id: str | None = None  # when it could be read, so batch collectors can account for it
    tenant_id: str | None = None
    batch_id: str | None = None
    worker_id: str = ""


class BatchManifest(BaseModel):
    batch_id: str
    tenant_id: str
    request_ids: list[str]
    source: str = ""
    created_at: str = ""


@dataclass(frozen=True)
class Rejection:
    """Why a message is not a valid job; `addressable` when it can still be answered with a result."""

    error: ErrorInfo
    addressable: bool
    request_id: str | None = None
    tenant_id: str | None = None
    batch_id: str | None = None


def _describe(e: dict, total: int) -> ErrorInfo:
    field = ".".join(str(p) for p in e["loc"]) or None
    msg = e["msg"].removeprefix("Value error, ")
    hint = {
        "missing": f"add the field `{field}`",
        "extra_forbidden": f"remove `{field}`; see the job contract in DESIGN.md for the known fields",
    }.get(e["type"], "fix the value and send the job again")
    where = f"{field}: " if field else ""
    more = f" (+{total - 1} more)" if total > 1 else ""
    return ErrorInfo(code="invalid_job", field=field, message=f"{where}{msg}; {hint}{more}")


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def parse_job(raw: bytes | None) -> Job | Rejection:
    """Decode and validate one message value."""
    if raw is None:
        return Rejection(ErrorInfo(code="malformed_json", message="empty message value; send a JSON object"), False)
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Rejection(
            ErrorInfo(code="malformed_json", message=f"not valid UTF-8 JSON ({e}); send one JSON object per message"),
            False,
        )
    if not isinstance(data, dict):
        return Rejection(
            ErrorInfo(code="malformed_json", message=f"expected a JSON object, got {type(data).__name__}"), False
        )
    ids = {k: _str_or_none(data.get(k)) for k in ("request_id", "tenant_id", "batch_id")}
    try:
        return Job.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
    identity = [err for err in errors if err["loc"] and str(err["loc"][0]) in ("request_id", "tenant_id", "v")]
    info = _describe((identity or errors)[0], len(errors))
    addressable = not identity and ids["request_id"] is not None and ids["tenant_id"] is not None
    return Rejection(info, addressable, **ids)
