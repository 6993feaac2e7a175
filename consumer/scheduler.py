"""Fair scheduling of routed jobs into engine batches.

- Strict priority tiers: a higher `priority` is always served first.
- Within a tier, start-time fair queuing between tenants on virtual time counted in tokens (Goyal et
  al., "Start-time Fair Queueing", SIGCOMM 1996): a job's start tag is max(V, the tenant's previous
  finish tag), its finish tag start + tokens / weight, and the job with the smallest start tag goes
  next. A tenant sending 10x another's volume therefore cannot push the other's jobs back: each new job
  of the small tenant starts at the current virtual time, ahead of the big tenant's backlog.
- Per-tenant token buckets (requests and tokens per minute): over them a tenant's jobs wait (or were
  failed with `quota_exceeded` when pushed, if they asked to). A job takes its estimate (prompt + max_new_tokens)
  when dispatched and is settled to the tokens the engine ran when it leaves (`finished`): a job stopped early by a
  stop string or EOS gives back what it did not generate, a job refused or failed before running gives back all of
  it, and a prompt the estimate undercounted (CJK text) pays the rest.
- Adapter affinity within a bounded slack: among heads whose start tags are within `affinity_slack`
  tokens of the smallest, prefer an adapter already in the batch, then one already on the GPU; a job
  is passed over this way for at most `max_defer_ms`, so nobody starves.
- Headroom: the last `headroom` free engine slots go only to tenants running fewer jobs than their
  weighted share of the engine. A flooding tenant therefore leaves a slot or two free, and a light
  tenant's next job is admitted at the next step instead of waiting for the flood's jobs to finish;
  alone, a tenant's share is the whole engine and it uses every slot.
- At most `max_adapters_per_batch` distinct adapters, `max_batch_size` requests, `max_batch_tokens`
  tokens per batch.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("lorabatch.worker")


@dataclass
class Pending:
    """A validated, routed job waiting for the engine."""

    tenant_id: str
    adapter_key: str | None  # engine key of the adapter, None for the base model
    tokens: int  # prompt + max_new_tokens: its cost in the batch and in virtual time
    enqueued_at: float  # monotonic seconds
    payload: Any = field(repr=False)
    partition: Any = None
    priority: int = 0
    start_tag: float = 0.0
    finish_tag: float = 0.0


class TokenBucket:
    """Up to `per_minute` units, refilled continuously; 0 means unlimited."""

    def __init__(self, per_minute: int, now: float):
        self.per_minute = max(0, per_minute)  # a negative limit (Scheduler.set_policy says so) is no limit, not a bucket
        self.level = float(per_minute)
        self.at = now

    def _refill(self, now: float) -> None:
        if self.per_minute:
            self.level = min(self.per_minute, self.level + (now - self.at) * self.per_minute / 60.0)
        self.at = now

    def can_take(self, amount: float, now: float) -> bool:
        if not self.per_minute:
            return True
        self._refill(now)
        # A request larger than the whole bucket may still pass when the bucket is full, else it never could.
        return self.level >= min(amount, self.per_minute)

    def can_take_after(self, ahead: float, amount: float, now: float) -> bool:
        """Whether `amount` could be taken now after `ahead` units queued before it were taken first: the cap of a
        lone request larger than the bucket (`can_take`) is for the last one, not for what waits ahead of it."""
        if not self.per_minute:
            return True
        self._refill(now)
        return self.level - ahead >= min(amount, self.per_minute)

    def take(self, amount: float, now: float) -> None:
        if self.per_minute:
            self._refill(now)
            self.level -= amount

    def give(self, amount: float, now: float) -> None:
        """Return `amount` taken before (negative: take more), never past a full bucket."""
        if self.per_minute:
            self._refill(now)
            self.level = min(self.per_minute, self.level + amount)


@dataclass
class TenantPolicy:
    weight: int = 1
    requests_per_minute: int = 0  # 0: unlimited
    tokens_per_minute: int = 0


class _Tier:
    def __init__(self) -> None:
        self.virtual_time = 0.0
        self.queues: dict[str, deque[Pending]] = {}
        self.last_finish: dict[str, float] = {}


class Scheduler:
    def __init__(self, max_batch_size: int, max_batch_tokens: int, max_adapters_per_batch: int,
                 affinity_slack: float = 512.0, max_defer_ms: float = 200.0, capacity: int = 0, headroom: int = 0,
                 clock=time.monotonic):
        assert max_batch_size >= 1 and max_batch_tokens >= 1 and max_adapters_per_batch >= 1
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_adapters = max_adapters_per_batch
        self.affinity_slack = affinity_slack
        self.max_defer_s = max_defer_ms / 1000
        self._clock = clock
        self._tiers: dict[int, _Tier] = {}
        self._policies: dict[str, TenantPolicy] = {}
        self._buckets: dict[str, tuple[TokenBucket, TokenBucket]] = {}
        self._queued = 0
        self._queued_tokens = 0
        self.capacity = capacity  # engine slots, for the headroom rule; 0 turns it off
        self.headroom = headroom if capacity else 0
        self._in_flight: dict[str, int] = {}

    # ------------------------------------------------------------------ policy

    def set_policy(self, tenant_id: str, policy: TenantPolicy) -> None:
        old = self._policies.get(tenant_id)
        self._policies[tenant_id] = policy
        if old is None or (old.requests_per_minute, old.tokens_per_minute) != (policy.requests_per_minute, policy.tokens_per_minute):
            # `tenants limits` refuses a negative limit, but a row written by hand can hold one: as a bucket it let one
            # job through and then none, for good, with next_eligible_in saying "now" every 5 ms
            for name, flag, value in (("requests_per_minute", "--rpm", policy.requests_per_minute),
                                      ("tokens_per_minute", "--tpm", policy.tokens_per_minute)):
                if value < 0:
                    log.warning("tenant %r has %s=%d in the registry; limits are 0 (unlimited) or more, so it is served "
                                "as unlimited; set it with `lorabatch tenants limits %s %s N`", tenant_id, name, value,
                                tenant_id, flag)  # fmt: skip
            now = self._clock()
            self._buckets[tenant_id] = (TokenBucket(policy.requests_per_minute, now), TokenBucket(policy.tokens_per_minute, now))

    def _policy(self, tenant_id: str) -> TenantPolicy:
        return self._policies.setdefault(tenant_id, TenantPolicy())

    def _bucket(self, tenant_id: str) -> tuple[TokenBucket, TokenBucket]:
        if tenant_id not in self._buckets:
            p, now = self._policy(tenant_id), self._clock()
            self._buckets[tenant_id] = (TokenBucket(p.requests_per_minute, now), TokenBucket(p.tokens_per_minute, now))
        return self._buckets[tenant_id]

    def over_quota(self, tenant_id: str, tokens: int) -> bool:
        """Would a new job of this size wait for quota behind what the tenant has queued already?"""
        reqs, toks = self._bucket(tenant_id)
        now = self._clock()
        queued = [p for t in self._tiers.values() for p in t.queues.get(tenant_id, ())]
        return not (reqs.can_take_after(len(queued), 1, now) and toks.can_take_after(sum(p.tokens for p in queued), tokens, now))

    # ------------------------------------------------------------------ queueing

    def __len__(self) -> int:
        return self._queued

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    def push(self, item: Pending) -> None:
        tier = self._tiers.setdefault(item.priority, _Tier())
        weight = max(1, self._policy(item.tenant_id).weight)
        q = tier.queues.setdefault(item.tenant_id, deque())
        item.start_tag = max(tier.virtual_time, tier.last_finish.get(item.tenant_id, 0.0))
        item.finish_tag = item.start_tag + item.tokens / weight
        tier.last_finish[item.tenant_id] = item.finish_tag
        q.append(item)
        self._queued += 1
        self._queued_tokens += item.tokens

    def finished(self, item: Pending, used_tokens: int | None = None, request_back: bool = False) -> None:
        """A dispatched job left the engine: its tenant holds one slot fewer. `used_tokens`: the tokens it ran (its
        prompt and what it generated), to which its token quota is settled (None: it keeps its estimate, `item.tokens`);
        `request_back`: it ran nothing and its answer is not kept (a resend runs again), so its request is returned too."""
        reqs, toks = self._bucket(item.tenant_id)
        now = self._clock()
        if used_tokens is not None:
            toks.give(item.tokens - used_tokens, now)
        if request_back:
            reqs.give(1, now)
        left = self._in_flight.get(item.tenant_id, 0) - 1
        if left > 0:
            self._in_flight[item.tenant_id] = left
        else:
            self._in_flight.pop(item.tenant_id, None)

    def _under_share(self, tenant_id: str) -> bool:
        active = set(self._in_flight) | {t for tier in self._tiers.values() for t, q in tier.queues.items() if q}
        total = sum(max(1, self._policy(t).weight) for t in active) or 1
        share = self.capacity * max(1, self._policy(tenant_id).weight) / total
        return self._in_flight.get(tenant_id, 0) < share

    def pop_batch(self, resident: set[str | None] | frozenset = frozenset(), max_requests: int | None = None) -> list[Pending]:
        """The next batch in fair order, within the batch limits; `max_requests` is the engine's free slots."""
        limit = min(self.max_batch_size, max_requests or self.max_batch_size)
        now = self._clock()
        batch: list[Pending] = []
        tokens = 0
        adapters: set[str | None] = set()
        for prio in sorted(self._tiers, reverse=True):
            tier = self._tiers[prio]
            blocked: set[str] = set()  # tenants out of quota or whose head does not fit this batch
            while len(batch) < limit:
                heads = [(q[0], t) for t, q in tier.queues.items() if q and t not in blocked]
                if not heads:
                    break
                item, tenant = self._choose(heads, adapters, resident, now)
                fits = (len(adapters | {item.adapter_key}) <= self.max_adapters
                        and (not batch or tokens + item.tokens <= self.max_batch_tokens))
                reqs, toks = self._bucket(tenant)
                reserved = max_requests is not None and max_requests - len(batch) <= self.headroom
                if (not fits or not (reqs.can_take(1, now) and toks.can_take(item.tokens, now))
                        or (reserved and not self._under_share(tenant))):
                    blocked.add(tenant)
                    continue
                tier.queues[tenant].popleft()
                if not tier.queues[tenant]:
                    del tier.queues[tenant]
                reqs.take(1, now)
                toks.take(item.tokens, now)
                tier.virtual_time = max(tier.virtual_time, item.start_tag)
                batch.append(item)
                self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
                tokens += item.tokens
                adapters.add(item.adapter_key)
                self._queued -= 1
                self._queued_tokens -= item.tokens
            if len(batch) >= limit:
                break
        return batch

    def _choose(self, heads: list[tuple[Pending, str]], in_batch: set, resident, now: float) -> tuple[Pending, str]:
        first = min(heads, key=lambda h: (h[0].start_tag, h[0].enqueued_at))
        if now - first[0].enqueued_at >= self.max_defer_s:
            return first  # waited long enough: no more passing over it
        window = [h for h in heads if h[0].start_tag <= first[0].start_tag + self.affinity_slack]
        for prefer in (in_batch, resident):
            near = [h for h in window if h[0].adapter_key in prefer]
            if near and first[0].adapter_key not in prefer:
                return min(near, key=lambda h: (h[0].start_tag, h[0].enqueued_at))
        return first

    def next_eligible_in(self) -> float | None:
        """Seconds until some queued tenant regains quota (0 when one is eligible now), None when empty."""
        if not self._queued:
            return None
        now = self._clock()
        waits = []
        for tier in self._tiers.values():
            for tenant, q in tier.queues.items():
                if not q:
                    continue
                reqs, toks = self._bucket(tenant)
                need = [(reqs, 1.0), (toks, float(q[0].tokens))]
                wait = 0.0
                for bucket, amount in need:
                    if bucket.per_minute and not bucket.can_take(amount, now):
                        wait = max(wait, (min(amount, bucket.per_minute) - bucket.level) * 60.0 / bucket.per_minute)
                waits.append(wait)
        return min(waits) if waits else None

    def drop(self, partitions: set) -> list[Pending]:
        """Remove and return the jobs of revoked partitions."""
        dropped: list[Pending] = []
        for tier in self._tiers.values():
            for tenant in list(tier.queues):
                keep: deque[Pending] = deque()
                for p in tier.queues[tenant]:
                    (dropped if p.partition in partitions else keep).append(p)
                if keep:
                    tier.queues[tenant] = keep
                else:
                    del tier.queues[tenant]
        self._queued -= len(dropped)
        self._queued_tokens -= sum(p.tokens for p in dropped)
        return dropped

    def depth_by_tenant(self) -> dict[str, int]:
        depth: dict[str, int] = {}
        for tier in self._tiers.values():
            for tenant, q in tier.queues.items():
                depth[tenant] = depth.get(tenant, 0) + len(q)
        return depth
