"""The job and result contract (README.md, "Job and result contract"), versioned with `v`.

A message that is not a JSON object, or lacks a usable `request_id` / `tenant_id`, cannot be answered
and goes to the DLQ. Any other invalid field gets a `failed` result that names the field and the fix.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, ValidationError, model_validator
from pydantic_core import PydanticCustomError

CONTRACT_VERSION = 1
MAX_NEW_TOKENS = 131_072  # the contract's bound; each engine also has its own (engine.max_new_tokens)
MAX_TOKEN_ID = 2**31 - 1
MAX_TOP_K = 1_000_000  # any top_k at or above the vocabulary is no cut
MAX_SEED = 2**63 - 1
DLQ_RAW_BYTES = 65_536  # at most this much of an unanswerable message is kept in its DLQ record

Ident = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@/\-]+$")]
TenantId = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")]
AdapterRef = Annotated[str, StringConstraints(min_length=1, max_length=160, pattern=r"^[A-Za-z0-9_.\-/]+(@[0-9]+)?$")]


def _whole_text(value: str) -> str:
    """Text that UTF-8 can carry: JSON's \\ud800-\\udfff escapes give a lone half of a UTF-16 pair, which no tokenizer,
    result or ledger row can hold."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "lone_surrogate", "holds a lone UTF-16 surrogate (\\u{code}) at character {at}, which is not text; "
            "send the whole character (both halves of its escape pair) or leave it out", {"code": f"{ord(value[e.start]):04x}", "at": e.start},
        ) from None
    return value


def _exactly_one(value: object) -> object:
    """The contract's version as a JSON integer: 1 is 1; true and 1.0 are not (a strict Literal lets them through)."""
    if type(value) is not int:
        raise PydanticCustomError("literal_error", "Input should be the integer 1, got {got}", {"got": repr(value)[:40]})
    return value


def _whole_text_first(value: object) -> object:
    """`_whole_text` before a string's own constraints: pydantic's length check cannot read a lone surrogate and said only
    'unable to parse raw data as a unicode string'."""
    return _whole_text(value) if isinstance(value, str) else value


Text = Annotated[str, AfterValidator(_whole_text)]
Version = Annotated[Literal[1], BeforeValidator(_exactly_one)]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["system", "user", "assistant", "tool"]
    content: Text


class Job(BaseModel):
    # Strict: a number is a JSON number and a flag a JSON boolean ("5", "yes" and true-for-1 are refused,
    # naming the field), so what a producer meant is never guessed.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    v: Version = CONTRACT_VERSION
    request_id: Ident
    tenant_id: TenantId
    batch_id: Ident | None = None
    # What the job asks for: `name` or `name@version`. The JSON field is `adapter_ref`; `adapter`, its
    # older name, is read as the same field (producers send it), and a job giving both must agree.
    adapter_ref: AdapterRef | None = Field(None, validation_alias=AliasChoices("adapter_ref", "adapter"),
                                           description="name or name@version; absent: route it")
    user_id: Ident | None = None
    session_id: Ident | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    input_ids: list[Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]] | None = None
    max_new_tokens: int = Field(64, ge=1, le=MAX_NEW_TOKENS)
    temperature: float = Field(0.0, ge=0.0, le=5.0, allow_inf_nan=False, description="0, or near it, is greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, le=MAX_TOP_K, description="0: no top-k cut")
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # null is no stop strings, as null is the default for the job's other optional fields
    stop: Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=64), BeforeValidator(_whole_text_first)]],
                    BeforeValidator(lambda v: [] if v is None else v)] = Field(
        default_factory=list, max_length=8)  # fmt: skip
    priority: int = Field(0, ge=-100, le=100)
    allow_base_fallback: bool = False
    on_quota: Literal["wait", "fail"] = Field("wait", description="over the tenant's rate limit: wait, or fail with quota_exceeded")
    logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _one_adapter_ref(cls, data: object) -> object:
        if not (isinstance(data, dict) and "adapter_ref" in data and "adapter" in data):
            return data
        ref, old = data["adapter_ref"], data["adapter"]
        if type(ref) is not type(old) or ref != old:  # 1 and true, or 1 and 1.0, are not the same value in JSON
            raise PydanticCustomError(
                "adapter_ref_conflict", "adapter_ref ({ref}) and adapter ({old}) differ; they are one field (adapter is its older name)",
                {"ref": repr(ref)[:80], "old": repr(old)[:80]},
            )
        return {k: v for k, v in data.items() if k != "adapter"}  # the same value twice: read once

    @model_validator(mode="after")
    def _one_input(self) -> "Job":
        # Raised with the field they are about in their context (`describe` names it in the failed result).
        given = [k for k in ("prompt", "messages", "input_ids") if getattr(self, k) is not None]
        if len(given) != 1:
            raise PydanticCustomError(
                "input_count", "give exactly one of prompt, messages or input_ids (got {got})",
                {"got": ", ".join(given) or "none", "field": given[1] if given else "prompt"},
            )
        empty = {"prompt": "at least one character", "messages": "at least one message", "input_ids": "at least one token id"}
        if not getattr(self, given[0]):
            raise PydanticCustomError("empty_input", "is empty; send {what}", {"field": given[0], "what": empty[given[0]]})
        return self


class Usage(BaseModel):
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0


class Cost(BaseModel):
    """A request's cost components in GPU milliseconds (README.md, "Billing"): base, LoRA compute, the routing
    decision, the KV credit and the cold-start share (filled in by the invoice at period close, 0 here)."""

    base_ms: float = 0.0
    lora_ms: float = 0.0  # its token share of its steps' LoRA compute
    routing_ms: float = 0.0  # the routing decision alone
    kv_saved_ms: float = 0.0  # the KV credit as billed (billing.credit): never more than base_ms + lora_ms
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
    # The message value's first DLQ_RAW_BYTES bytes: decoded as UTF-8 with replacement, and exactly (base64).
    # raw_bytes and raw_sha256 are of the whole value, so a truncated record still identifies it.
    raw: str
    raw_b64: str
    raw_bytes: int = 0
    raw_sha256: str = ""
    raw_truncated: bool = False
    request_id: str | None = None  # when it could be read, so batch collectors can account for it
    tenant_id: str | None = None
    batch_id: str | None = None
    worker_id: str = ""


class OpenAIRequest(BaseModel):
    """What an OpenAI Batch API line asked for, kept so that its result is answered in the same terms."""

    custom_id: str
    url: Literal["/v1/chat/completions", "/v1/completions"]
    model: str | None = None  # body.model as written (`support`, not the resolved `support@1`)
    # which of the two the line gave its token limit in, so that an error names it (None: max_tokens, or neither)
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] | None = None


class BatchManifest(BaseModel):
    batch_id: str
    tenant_id: str
    request_ids: list[str]
    source: str = ""
    created_at: str = ""
    # request id -> its OpenAI Batch line, for the requests submitted as such (in parts of their own)
    openai: dict[str, OpenAIRequest] = Field(default_factory=dict)
    # A submission that produces a file as it reads it opens it with a part of False and closes it with one of True;
    # the parts between (and a batch written at once) carry None. read_manifest gives the last one that is not None.
    complete: bool | None = None
    # request id -> 16 hex digits of the sha256 of its job's Kafka value (`lorabatch submit` writes them): a later file
    # submitted under the same batch id whose line has that id but other content is refused, not answered with this one
    digests: dict[str, str] = Field(default_factory=dict)


@dataclass(frozen=True)
class Rejection:
    """Why a message is not a valid job; `addressable` when it can still be answered with a result."""

    error: ErrorInfo
    addressable: bool
    request_id: str | None = None
    tenant_id: str | None = None
    batch_id: str | None = None


def _allowed(name: str) -> str | None:
    """The allowed range of a numeric job field, as `lo..hi` (from its Field constraints), or None."""
    info = Job.model_fields.get(name)
    if info is None:
        return None
    lo = hi = None
    for c in info.metadata:
        lo = getattr(c, "ge", None) if getattr(c, "ge", None) is not None else lo
        lo = f"> {c.gt}" if getattr(c, "gt", None) is not None else lo
        hi = getattr(c, "le", None) if getattr(c, "le", None) is not None else hi
    if lo is None and hi is None:
        return None
    if isinstance(lo, str):
        return f"{lo} and <= {hi}"
    return f"{lo}..{hi}"


# Errors whose own message already says what to send
_SAYS_THE_FIX = frozenset({"lone_surrogate", "empty_input", "input_count"})
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number",
                           "int_parsing", "int_type", "float_parsing", "float_type", "int_from_float"})


_IDENT_RULE = "1 to 128 ASCII letters, digits, '_', '.', ':', '@', '/' or '-'"
# What a field takes, in the README's words, for the errors that are not about a number's range
_WHAT_TO_SEND = {
    "request_id": _IDENT_RULE, "batch_id": _IDENT_RULE, "user_id": _IDENT_RULE, "session_id": _IDENT_RULE,
    "tenant_id": "1 to 64 ASCII letters, digits, '_', '.' or '-', the first a letter or digit",
    "adapter_ref": "`name` or `name@version` as a string (1 to 160 of A-Za-z0-9_.-/, then @N)",
    "adapter": "`name` or `name@version` as a string (1 to 160 of A-Za-z0-9_.-/, then @N)",
    "prompt": "a non-empty string",
    "messages": 'a non-empty list of {"role": "system" | "user" | "assistant" | "tool", "content": "text"} objects',
    "input_ids": f"a non-empty list of token ids 0..{MAX_TOKEN_ID}",
    "stop": "a list of up to 8 strings of 1 to 64 characters",
    "allow_base_fallback": "true or false",
    "v": "the integer 1, or leave it out",
    "on_quota": '"wait" or "fail"',
}


_SHOWN_CHARS = 64  # of a field name the producer wrote, in an error: a key may be the megabyte its message allows


def shown_name(name: str) -> str:
    """A field name as an error shows it: a lone surrogate escaped (`\\ud800`: the result must be UTF-8), and past
    _SHOWN_CHARS characters cut, with its length (the name echoed whole made a failed result too large to publish)."""
    text = name.encode("utf-8", "backslashreplace").decode()
    return text if len(text) <= _SHOWN_CHARS else f"{text[:_SHOWN_CHARS]}... ({len(name)} characters)"


def error_field(e: dict) -> str | None:
    """The job field a validation error is about: its location, or for the job's own checks the field they name."""
    return ".".join(str(p) for p in e["loc"]) or (e.get("ctx") or {}).get("field") or (
        "adapter_ref" if e["type"] == "adapter_ref_conflict" else None)


def describe(e: dict, total: int, field: str | None = None) -> ErrorInfo:
    """The failed result's error for a job's first validation error `e` of `total`: the field, what is wrong, the fix.
    `field` names the job field as its sender wrote it (an OpenAI Batch line's `body.max_tokens`), when not as the job
    does."""
    field = field or error_field(e)
    field = shown_name(field) if field else None
    msg = e["msg"].removeprefix("Value error, ")
    allowed = _allowed(str(e["loc"][0])) if e["loc"] and e["type"] in _RANGE_ERRORS else None
    if e["loc"] and str(e["loc"][0]) == "input_ids" and e["type"] in _RANGE_ERRORS:
        allowed = f"0..{MAX_TOKEN_ID} for each token id"
    hint = {
        "missing": f"add the field `{field}`",
        "extra_forbidden": f"remove `{field}`; the README's \"Job and result contract\" lists the known fields",
        "adapter_ref_conflict": "send adapter_ref alone",
    }.get(e["type"], f"send a value in {allowed}" if allowed else _send(e))
    if e["type"] in _SAYS_THE_FIX:
        hint = ""
    where = f"{field}: " if field else ""
    more = f" (+{total - 1} more)" if total > 1 else ""
    return ErrorInfo(code="invalid_job", field=field, message=f"{where}{msg}{'; ' + hint if hint else ''}{more}")


def _send(e: dict) -> str:
    """The fix for an error that is not about a number's range: what the field takes."""
    what = _WHAT_TO_SEND.get(str(e["loc"][0])) if e["loc"] else None
    return f"send {what}" if what else "fix the value and send the job again"


_ECHOABLE = re.compile(r"[A-Za-z0-9_.:@/\-]{1,256}")


def _str_or_none(value: object) -> str | None:
    """An identity field worth echoing into a failed result or DLQ record: a short id of plain characters
    (a lone surrogate or a megabyte of text would make the record itself unsendable)."""
    return value if isinstance(value, str) and _ECHOABLE.fullmatch(value) else None


_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:@/\-]{1,128}")  # Ident and TenantId, for the paths that answer before validating
_TENANT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")


def _usable(ids: dict[str, str | None], data: dict) -> bool:
    """Whether the identity read from a job that failed before (or beside) its fields' validation is one the contract
    answers (a request id of 129..256 characters is echoable, not usable: the validating path sends such a job to the
    DLQ), in the contract's version (`v` absent, or the JSON integer 1: any other goes to the DLQ, whatever else is
    wrong)."""
    rid, tid, v = ids["request_id"], ids["tenant_id"], data.get("v", CONTRACT_VERSION)
    return (rid is not None and tid is not None and bool(_REQUEST_ID.fullmatch(rid)) and bool(_TENANT_ID.fullmatch(tid))
            and type(v) is int and v == CONTRACT_VERSION)


def load_json(text: str) -> tuple[object, list[tuple[str, dict]]]:
    """json.loads, and each key an object of it gives twice, with that object (json.loads alone keeps the last value,
    where another reader of the same bytes, a gateway say, may have gone by the first)."""
    repeated: list[tuple[str, dict]] = []

    def pairs(items: list[tuple[str, object]]) -> dict:
        obj = dict(items)
        if len(obj) < len(items):
            seen: set[str] = set()
            repeated.extend((k, obj) for k, _ in items if k in seen or seen.add(k))
        return obj

    return json.loads(text, object_pairs_hook=pairs), repeated


def _given_twice(data: dict, key: str, obj: dict) -> str:
    """The job field a repeated key is: itself at the top, `messages.N.key` inside a chat message."""
    if obj is data:
        return key
    return next((f"{name}.{i}.{key}" for name, value in data.items() if isinstance(value, list)
                 for i, item in enumerate(value) if item is obj), key)


def _name_not_text(data: dict) -> str | None:
    """The first key of the job object or of a chat message that holds a lone surrogate, as its field path (pydantic
    refuses such an object whole, naming no key: 'unable to parse raw data as a unicode string')."""
    messages = data.get("messages")
    objs = [("", data)] + ([(f"messages.{i}.", m) for i, m in enumerate(messages) if isinstance(m, dict)]
                           if isinstance(messages, list) else [])
    for prefix, obj in objs:
        for key in obj:
            if not key.isascii():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return prefix + shown_name(key)
    return None


def parse_job(raw: bytes | None) -> Job | Rejection:
    """Decode and validate one message value."""
    if raw is None:
        return Rejection(ErrorInfo(code="malformed_json", message="empty message value; send a JSON object"), False)
    try:
        data, repeated = load_json(raw.decode("utf-8"))  # UTF-8 only: json.loads on bytes would also take UTF-16 and -32
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return Rejection(
            ErrorInfo(code="malformed_json", message=f"not valid UTF-8 JSON ({e}); send one JSON object per message"),
            False,
        )
    except (RecursionError, ValueError, MemoryError) as e:  # nesting too deep, an integer of thousands of digits
        return Rejection(ErrorInfo(code="malformed_json", message=f"the JSON cannot be decoded ({type(e).__name__}: "
                                   f"{str(e)[:200]}); send a flat job object of plain numbers and strings"), False)
    if not isinstance(data, dict):
        return Rejection(
            ErrorInfo(code="malformed_json", message=f"expected a JSON object, got {type(data).__name__}"), False
        )
    ids = {k: _str_or_none(data.get(k)) for k in ("request_id", "tenant_id", "batch_id")}
    if repeated:
        # Strict as the types are: which of two values the producer meant is not guessed. A repeated identity cannot
        # be answered under either value (its job may be another tenant's).
        key, obj = repeated[0]
        field = shown_name(_given_twice(data, key, obj))
        if obj is data and key in ids:
            ids[key] = None
        info = ErrorInfo(code="invalid_job", field=field, message=f"{field}: given twice in one object (JSON readers "
                         f"differ on which value counts); give each field once")
        return Rejection(info, not (obj is data and key in ("request_id", "tenant_id", "v")) and _usable(ids, data), **ids)
    if (field := _name_not_text(data)) is not None:
        info = ErrorInfo(code="invalid_job", field=field, message=f"{field}: this field name holds a lone UTF-16 surrogate, "
                         f"which is not text; remove the field (the README's \"Job and result contract\" lists the known fields)")
        return Rejection(info, _usable(ids, data), **ids)
    try:
        return Job.model_validate(data)
    except ValidationError as e:
        errors = e.errors(include_input=False, include_url=False)
    except RecursionError:
        return Rejection(ErrorInfo(code="invalid_job", message="the job nests values too deeply; send the fields "
                                   "the README's \"Job and result contract\" lists"), _usable(ids, data), **ids)
    identity = [err for err in errors if err["loc"] and str(err["loc"][0]) in ("request_id", "tenant_id", "v")]
    info = describe((identity or errors)[0], len(errors))
    # _usable too: a model validator's error (adapter_ref against adapter) is the only one reported, the identity's unchecked
    addressable = not identity and _usable(ids, data)
    return Rejection(info, addressable, **ids)


def dlq_raw_limit(max_bytes: int) -> int:
    """How much of a value a DLQ record keeps in a message of `max_bytes` (`dlq_record`)."""
    return min(DLQ_RAW_BYTES, max(0, max_bytes // 16))


def dlq_record(raw: bytes | None, error: ErrorInfo, *, topic: str, partition: int, offset: int, timestamp_ms: int | None,
               worker_id: str, max_bytes: int, request_id: str | None = None, tenant_id: str | None = None,
               batch_id: str | None = None) -> DlqRecord:
    """A DLQ record for one message value that fits a message of `max_bytes`: the value is cut to a share of
    the limit (escaping can grow text six-fold, base64 by a third), its length and sha256 kept whole."""
    raw = raw or b""
    keep = dlq_raw_limit(max_bytes)
    head = raw[:keep]
    return DlqRecord(
        error=error.model_copy(update={"message": error.message[: max(200, min(2000, max_bytes // 16))]}), source_topic=topic, source_partition=partition,
        source_offset=offset, source_timestamp_ms=timestamp_ms, raw=head.decode("utf-8", "replace"),
        raw_b64=base64.b64encode(head).decode(), raw_bytes=len(raw), raw_sha256=hashlib.sha256(raw).hexdigest(),
        raw_truncated=len(head) < len(raw), request_id=request_id, tenant_id=tenant_id, batch_id=batch_id,
        worker_id=worker_id,
    )
