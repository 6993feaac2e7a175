"""Per-partition offset bookkeeping for effectively-once consumption.

A message counts as done once its result is published and its ledger row written (or its DLQ record
published). Only the highest *contiguous* done offset may be committed: with offsets 5, 6, 7 fetched
and 5 and 7 done, the commit stays at 6 (i.e. "next to read is 6") until 6 is done, so a crash
redelivers 6 and 7 and the ledger's unique key absorbs the repeat of 7.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PartitionOffsets:
    next_commit: int | None = None  # the offset Kafka should resume from (last contiguous done + 1)
    pending: set[int] = field(default_factory=set)  # fetched, not yet done
    done: set[int] = field(default_factory=set)  # done, but above a pending offset
    committed: int | None = None  # what was last sent to the broker
    fetched_to: int | None = None  # one past the highest offset fetched

    def fetched(self, offset: int) -> bool:
        """Note a fetched offset; False when it is a redelivery of work already done here."""
        if self.next_commit is None:  # the group resumed us here, so this is what is committed already
            self.next_commit = self.committed = offset
        self.fetched_to = max(self.fetched_to or 0, offset + 1)
        if offset < self.next_commit or offset in self.done:
            return False
        self.pending.add(offset)
        return True

    def finished(self, offset: int) -> None:
        if offset not in self.pending:
            return
        self.pending.discard(offset)
        self.done.add(offset)
        while self.next_commit in self.done:
            self.done.discard(self.next_commit)
            self.next_commit += 1

    def to_commit(self) -> int | None:
        """The offset to commit now, or None when nothing new is committable."""
        if self.next_commit is None or self.next_commit == self.committed:
            return None
        return self.next_commit


class OffsetTracker:
    """Offsets of every assigned partition, keyed by any hashable partition id."""

    def __init__(self) -> None:
        self._parts: dict = {}

    def fetched(self, tp, offset: int) -> bool:
        return self._parts.setdefault(tp, PartitionOffsets()).fetched(offset)

    def finished(self, tp, offset: int) -> None:
        if tp in self._parts:
            self._parts[tp].finished(offset)

    def committable(self) -> dict:
        out = {}
        for tp, part in self._parts.items():
            if (offset := part.to_commit()) is not None:
                out[tp] = offset
        return out

    def mark_committed(self, offsets: dict) -> None:
        for tp, offset in offsets.items():
            if tp in self._parts:
                self._parts[tp].committed = offset

    def in_flight(self, tp=None) -> int:
        if tp is not None:
            return len(self._parts[tp].pending) if tp in self._parts else 0
        return sum(len(p.pending) for p in self._parts.values())

    def forget(self, partitions) -> None:
        """Drop revoked partitions: their unfinished work will be redelivered to the new owner."""
        for tp in partitions:
            self._parts.pop(tp, None)

    def next_fetch(self, tp) -> int | None:
        part = self._parts.get(tp)
        return part.fetched_to if part else None

    def partitions(self) -> list:
        return list(self._parts)
