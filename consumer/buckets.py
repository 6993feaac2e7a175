"""Per-adapter buckets: jobs wait by adapter until a bucket is full or has waited `max_wait_ms`.

A batch is then cut from the closed buckets, oldest first, with at most `max_adapters_per_batch`
distinct adapters, `max_batch_size` requests and `max_batch_tokens` tokens. The engine runs the rows of
different adapters in one forward pass, so mixing buckets in a batch costs nothing extra; bucketing
still pays because rows of one adapter share its weights' reads.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Pending:
    """A validated, routed job waiting for the engine."""

    adapter_key: str | None  # engine key of the adapter, None for the base model
    tokens: int  # prompt tokens + max_new_tokens: what it can occupy in the batch
    enqueued_at: float  # monotonic seconds
    payload: Any = field(repr=False)  # the worker's own record of the job
    partition: Any = None  # where it came from, so revoked partitions can drop their jobs


class AdapterBuckets:
    def __init__(self, max_batch_size: int, max_batch_tokens: int, max_wait_ms: int, max_adapters_per_batch: int):
        assert max_batch_size >= 1 and max_batch_tokens >= 1 and max_adapters_per_batch >= 1
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_ms / 1000
        self.max_adapters = max_adapters_per_batch
        self._buckets: OrderedDict[str | None, deque[Pending]] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(b) for b in self._buckets.values())

    def add(self, item: Pending) -> None:
        self._buckets.setdefault(item.adapter_key, deque()).append(item)

    def _closed(self, bucket: deque[Pending], now: float) -> bool:
        tokens = sum(p.tokens for p in bucket)
        full = len(bucket) >= self.max_batch_size or tokens >= self.max_batch_tokens
        return full or now - bucket[0].enqueued_at >= self.max_wait_s

    def next_deadline(self, now: float) -> float | None:
        """Seconds until the oldest bucket closes on time (0 when one is closed already), None when empty."""
        if not self._buckets:
            return None
        if any(self._closed(b, now) for b in self._buckets.values()):
            return 0.0
        oldest = min(b[0].enqueued_at for b in self._buckets.values())
        return max(0.0, oldest + self.max_wait_s - now)

    def take_batch(self, now: float, force: bool = False) -> list[Pending]:
        """Cut one batch from the closed buckets (all buckets when `force`), oldest bucket first."""
        ready = [k for k, b in self._buckets.items() if force or self._closed(b, now)]
        ready.sort(key=lambda k: self._buckets[k][0].enqueued_at)
        batch: list[Pending] = []
        tokens = 0
        for key in ready[: self.max_adapters]:
            bucket = self._buckets[key]
            while bucket and len(batch) < self.max_batch_size:
                nxt = bucket[0]
                if batch and tokens + nxt.tokens > self.max_batch_tokens:
                    break
                batch.append(bucket.popleft())
                tokens += nxt.tokens
            if not bucket:
                del self._buckets[key]
            if len(batch) >= self.max_batch_size or tokens >= self.max_batch_tokens:
                break
        return batch

    def drop(self, partitions: set) -> list[Pending]:
        """Remove and return the jobs of revoked partitions."""
        dropped: list[Pending] = []
        for key in list(self._buckets):
            keep = deque()
            for p in self._buckets[key]:
                (dropped if p.partition in partitions else keep).append(p)
            if keep:
                self._buckets[key] = keep
            else:
                del self._buckets[key]
        return dropped

    def queued_by_adapter(self) -> dict[str | None, int]:
        return {k: len(b) for k, b in self._buckets.items()}
