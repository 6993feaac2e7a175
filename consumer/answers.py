"""A request's identity and its stored answers: what the worker needs to answer a job without running it.

A request is (tenant_id, request_id). Its answer, once given, is kept: in the worker's memory, in the
spool while the ledger is away, and in the ledger's usage row (`result_json`). A copy of a running
request waits for the first one's answer (`Copy`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from aiokafka import TopicPartition

from billing.credit import kv_credit_us
from consumer.schemas import Cost, ErrorInfo, Job, Rejection, Result, Usage

Key = tuple[str, str]  # (tenant_id, request_id): a request's identity everywhere

# What an answer kept in memory takes, near enough (tracemalloc): the Result's own objects, about 2.8 KB; its text as
# Python holds it (1, 2 or 4 bytes a character); each output id a list slot and an int object (8 + 32 bytes as
# allocated). Counted at 8 bytes an id and 1 a character, 10,000 kept answers of 1,200 tokens took 519 MB of a worker,
# where ~200 MB were meant.
_RESULT_BYTES = 3_000
_ID_BYTES = 40


@dataclass
class Copy:
    """A message whose (tenant, request_id) is already running here: it waits for the first one's answer."""

    tp: TopicPartition
    offset: int
    epoch: int
    parsed: Job | Rejection
    silent: bool = False  # the same message read again: it needs no second result


def key_of(parsed: Job | Rejection) -> Key | None:
    """The identity of a job, or of a rejection that can still be answered; None for the DLQ's messages."""
    if isinstance(parsed, Job):
        return parsed.tenant_id, parsed.request_id
    if parsed.addressable and parsed.tenant_id is not None and parsed.request_id is not None:
        return parsed.tenant_id, parsed.request_id
    return None


def stored_result(key: Key, body: str | None, row) -> Result:
    """The answer stored with a ledger or spool row: its published body, or (rows older than the bodies'
    column) one rebuilt from the row's figures."""
    if body:
        return Result.model_validate_json(body)
    error = ErrorInfo(code=row.error_code, message="answered from the ledger row of an earlier run") if row.error_code else None
    return Result(request_id=key[1], tenant_id=key[0], batch_id=row.batch_id, adapter=row.adapter, status=row.status,
                  usage=Usage(input_tokens=row.input_tokens, output_tokens=row.output_tokens, cached_tokens=row.cached_tokens),
                  cost=Cost(base_ms=row.base_us / 1000, lora_ms=row.lora_us / 1000, routing_ms=row.routing_us / 1000,
                            kv_saved_ms=kv_credit_us(kv_saved_us=row.kv_saved_us, base_us=row.base_us, lora_us=row.lora_us,
                                                     input_tokens=row.input_tokens, cached_tokens=row.cached_tokens,
                                                     output_tokens=row.output_tokens) / 1000),
                  error=error, worker_id=row.worker_id)


def answer_bytes(result: Result) -> int:
    """The memory `result` takes while kept for a resend (module note above)."""
    return _RESULT_BYTES + sys.getsizeof(result.text) + _ID_BYTES * len(result.output_ids)
