"""The worker's assigned partitions: paused while work is over its bound, reset when their log was reset,
and their lag reported."""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.errors import KafkaError

from consumer.metrics import WorkerMetrics
from consumer.offsets import OffsetTracker

log = logging.getLogger("lorabatch.worker")


class Partitions:
    def __init__(self, consumer, offsets: OffsetTracker, metrics: WorkerMetrics):
        self.consumer = consumer
        self.offsets = offsets
        self.metrics = metrics
        self.paused = False
        self.checked_at = 0.0  # when the logs were last checked (monotonic)
        self._lag_shown: set[int] = set()  # partitions with a lorabatch_consumer_lag series

    def hold(self, why: str | None) -> None:
        """Pause fetching while there is a reason to (`why`), resume once there is none."""
        assigned = self.consumer.assignment()
        if why is not None and not self.paused and assigned:
            self.consumer.pause(*assigned)
            self.paused = True
            log.warning("fetching paused: %s", why)
        elif why is None and self.paused:
            self.consumer.resume(*self.consumer.paused())
            self.paused = False
            log.info("fetching resumed")

    async def check_logs(self) -> None:
        """Reset the marks of a partition whose log now ends below them (truncated, recreated, a memory-only
        broker restarted): the partition starts a new epoch and is read again from the beginning, as
        `auto_offset_reset = earliest` does. The log end is the high watermark of the latest fetch response
        (the embedded broker's ListOffsets answers the last batch's base offset + 1, not the log end).

        A partition this worker has fetched nothing from is checked at the consumer's position: a committed offset
        past the log's end (a worker's last commit of the old log, made into the restarted broker as it rejoined, or
        read by a worker started after) answers every fetch with no records and no error, so the jobs of the new log
        would never be read."""
        self.checked_at = time.monotonic()
        for tp in list(self.consumer.assignment()):
            mark, end = self.offsets.mark(tp), self.consumer.highwater(tp)
            if end is None:
                continue
            what = "this worker fetched"
            if mark is None:
                try:
                    mark = await asyncio.wait_for(self.consumer.position(tp), 1.0)
                except (KafkaError, TimeoutError):  # not known yet (being reset, revoked meanwhile): the next check
                    continue
                what = "the group's committed offset it was to read from"
            if end >= mark:
                continue
            self.offsets.reset(tp)
            self.metrics.log_resets.inc()
            await self.consumer.seek_to_beginning(tp)
            log.warning("the log of %s:%s ends at %s, below the %s %s: it was reset (a broker restart, a recreated "
                        "topic); its marks are dropped and it is read again from the beginning",
                        tp.topic, tp.partition, end, mark, what)

    def report_lag(self) -> None:
        """The lag of each assigned partition. A partition a rebalance took away leaves the gauge: its last figure stayed
        on, frozen, beside its new owner's (976 jobs behind, on a worker that no longer read it, while the new owner
        drained it), so a sum over the workers counted it twice and an alert on it never cleared."""
        assigned = self.consumer.assignment()
        for tp in assigned:
            high = self.consumer.highwater(tp)
            nxt = self.offsets.next_fetch(tp)
            if high is not None and nxt is not None:
                self.metrics.consumer_lag.labels(str(tp.partition)).set(max(0, high - nxt))
                self._lag_shown.add(tp.partition)
        for partition in self._lag_shown - {tp.partition for tp in assigned}:
            self.metrics.consumer_lag.remove(str(partition))
            self._lag_shown.discard(partition)
