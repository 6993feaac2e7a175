"""Per-step attribution: a measured engine step's time split over the requests in it, to the microsecond.

Semantics, for a step s with measured total_us(s) of which lora_us(s) was LoRA compute:
    base_us(r, s) = (total_us(s) - lora_us(s)) * tokens_r(s) / tokens(s)
    lora_us(r, s) = lora_us(s) * tokens_r(s) / lora_tokens(s)      (requests with an adapter only)
where tokens(s) counts every request's tokens in the step's forward and lora_tokens(s) only those of
requests with an adapter (DESIGN.md, cost attribution). Shares are whole microseconds apportioned by
largest remainder, so for every step sum_r base_us(r, s) + lora_us(r, s) == total_us(s) exactly: the
per-step conservation invariant. A request's base_us and lora_us in the ledger are its sums over the
steps it took part in, and a BusyRecord's busy_us is the sum of its steps' total_us.

The engine does this split as it runs; billing owns this statement of it over plain records (billing
imports nothing from the engine), for tests, benchmarks and any worker that reports raw steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from billing.apportion import apportion


@dataclass(frozen=True)
class StepRequest:
    """One request's part in a step: the tokens it put through the forward, and whether it used an adapter."""

    request_id: str
    tokens: int
    adapter: str | None = None  # "name@version"; None for the base model


@dataclass(frozen=True)
class Step:
    """One engine step as measured: its device time and the LoRA part of it, in integer microseconds."""

    total_us: int
    lora_us: int
    requests: tuple[StepRequest, ...]


@dataclass(frozen=True)
class RequestTime:
    """A request's attributed time, summed over steps."""

    base_us: int = 0
    lora_us: int = 0


def attribute_step(step: Step) -> dict[str, RequestTime]:
    """Split one step's time over its requests; the shares sum to step.total_us exactly."""
    assert 0 <= step.lora_us <= step.total_us, step
    ids = [r.request_id for r in step.requests]
    assert len(set(ids)) == len(ids), f"a request appears twice in one step: {ids}"
    tokens = {r.request_id: r.tokens for r in step.requests}
    lora_tokens = {r.request_id: r.tokens for r in step.requests if r.adapter is not None}
    assert all(t >= 0 for t in tokens.values()), tokens
    assert step.total_us == 0 or sum(tokens.values()) > 0, f"{step.total_us} us measured for a step without tokens"
    assert step.lora_us == 0 or sum(lora_tokens.values()) > 0, f"{step.lora_us} us of LoRA time in a step without adapter tokens"
    base = apportion(step.total_us - step.lora_us, tokens)
    lora = apportion(step.lora_us, lora_tokens)
    return {rid: RequestTime(base[rid], lora.get(rid, 0)) for rid in ids}


def attribute_steps(steps: Iterable[Step]) -> dict[str, RequestTime]:
    """Each request's base_us and lora_us summed over the steps it took part in."""
    totals: dict[str, RequestTime] = {}
    for step in steps:
        for rid, share in attribute_step(step).items():
            before = totals.get(rid, RequestTime())
            totals[rid] = RequestTime(before.base_us + share.base_us, before.lora_us + share.lora_us)
    return totals
