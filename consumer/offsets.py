"""Per-partition offset bookkeeping for effectively-once consumption, following the log actually served.

A message counts as done once its result is published and its ledger row written (or spooled), or its
DLQ record published. Only the highest *contiguous* done offset may be committed: with offsets 5, 6, 7
fetched and 5 and 7 done, the commit stays at 6 (i.e. "next to read is 6") until 6 is done, so a crash
redelivers 6 and 7 and the request identity (tenant, request_id) answers the repeat of 7 from what was
stored.

Marks belong to one *epoch* of a partition's log. The consumer reads a partition in increasing offset
order, so an offset at or below one already fetched means the fetch position went back: the log was
reset (a restarted memory-only broker, a recreated or truncated topic) and the consumer resumed from
the earliest offset. The partition then starts a new epoch from that offset; outcomes of the old epoch
still publish their results and bill their rows, but no longer move (or commit) the new epoch's marks.
The worker also resets a partition whose log ends below its mark, or whose committed offset the broker
no longer knows (see `Partitions.check_logs` in consumer/partitions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count


@dataclass
class PartitionOffsets:
    epoch: int
    next_commit: int | None = None  # the offset Kafka should resume from (the lowest pending, or one past all fetched)
    pending: set[int] = field(default_factory=set)  # fetched, not yet done
    committed: int | None = None  # what was last sent to the broker in this epoch
    fetched_to: int | None = None  # one past the highest offset fetched
    after_reset: bool = False  # a new epoch of a reset log: nothing of it is committed yet
    confirmed: bool = False  # this worker committed `committed` itself (the broker must know it)

    def fetched(self, offset: int, upto: int | None = None) -> None:
        """Note a fetched message; `upto` (one past the last offset it stands for) when it covers a range: one
        record batch that could not be decoded is one message here. Offsets never fetched between two that
        were (compacted away, transaction markers, a skipped batch) are no one's to wait for."""
        if self.next_commit is None:
            self.next_commit = offset
            if not self.after_reset:  # the group resumed us here, so this is what is committed already
                self.committed = offset
        self.fetched_to = max(self.fetched_to or 0, upto if upto is not None else offset + 1)
        self.pending.add(offset)

    def finished(self, offset: int) -> None:
        if offset not in self.pending:
            return
        self.pending.discard(offset)
        self.next_commit = min(self.pending) if self.pending else self.fetched_to

    def to_commit(self) -> int | None:
        """The offset to commit now, or None when nothing new is committable."""
        if self.next_commit is None or self.next_commit == self.committed:
            return None
        return self.next_commit

class OffsetTracker:
    """Offsets of every assigned partition, keyed by any hashable partition id."""

    def __init__(self) -> None:
        self._parts: dict = {}
        self._epochs = count(1)
        self.resets = 0  # log resets seen (a metric)
        self.left_on_revoke = 0  # offsets still pending in partitions when they were revoked: left to their next owner
        self._revoked_commits: dict = {}  # the last offset this worker committed in each partition revoked since

    def fetched(self, tp, offset: int, upto: int | None = None) -> int:
        """Note a fetched offset (standing for offsets up to `upto`, exclusive, when given); return the epoch
        its outcome must carry to `finished`."""
        part = self._parts.get(tp)
        if part is not None and part.fetched_to is not None and offset < part.fetched_to:
            part = self.reset(tp)  # the position went back: the log under the marks is not the one we read
        if part is None:
            part = self._parts[tp] = PartitionOffsets(next(self._epochs))
        part.fetched(offset, upto)
        return part.epoch

    def reset(self, tp) -> PartitionOffsets:
        """Drop a partition's marks (its log was reset); what is in flight finishes without moving them."""
        self.resets += 1
        part = self._parts[tp] = PartitionOffsets(next(self._epochs), after_reset=True)
        return part

    def finished(self, tp, offset: int, epoch: int | None = None) -> None:
        part = self._parts.get(tp)
        if part is not None and (epoch is None or epoch == part.epoch):
            part.finished(offset)

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
                self._parts[tp].confirmed = True

    def confirmed(self, tp) -> int | None:
        """The offset this worker itself committed in the partition's current epoch, or None."""
        part = self._parts.get(tp)
        return part.committed if part is not None and part.confirmed else None

    def mark(self, tp) -> int | None:
        """The highest offset this epoch claims the log holds (one past the last fetched)."""
        part = self._parts.get(tp)
        return part.fetched_to if part else None

    def in_flight(self, tp=None) -> int:
        if tp is not None:
            return len(self._parts[tp].pending) if tp in self._parts else 0
        return sum(len(p.pending) for p in self._parts.values())

    def forget(self, partitions) -> None:
        """Drop revoked partitions: their unfinished work will be redelivered to the new owner. What was pending in
        them and what this worker committed there are kept for the worker's last log line (`committed_here`)."""
        for tp in partitions:
            part = self._parts.pop(tp, None)
            if part is None:
                continue
            self.left_on_revoke += len(part.pending)
            if part.confirmed:
                self._revoked_commits[tp] = part.committed

    def committed_here(self) -> dict:
        """The last offset this worker committed in each partition, those revoked since included."""
        return {**self._revoked_commits, **{tp: p.committed for tp, p in self._parts.items() if p.confirmed}}

    def next_fetch(self, tp) -> int | None:
        part = self._parts.get(tp)
        return part.fetched_to if part else None

    def partitions(self) -> list:
        return list(self._parts)
