"""The spool's flusher, a part of the Deliverer (consumer.delivery): spooled records to the ledger once it takes them.

This worker's own spool file every `flush_s` (`flush_once`), and every ADOPT_EVERY_S the files that other workers left
beside it (`flush_others`). Each run of records is written to the ledger, then removed from its spool: a removal that
fails (the spool's disk full, its file damaged) leaves them to be written again, which the ledger's idempotent keys make
harmless, and is the spool's failure, said as such; the ledger is not said down for it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sqlite3
import time
from collections.abc import Callable, Sequence

from billing.errors import LedgerRecordError
from billing.records import AdapterLoadRecord, BusyRecord, UsageRecord
from consumer.spool import Spool

log = logging.getLogger("lorabatch.worker")

_BACKOFF_MAX_S = 5.0
ADOPT_EVERY_S = 60.0  # how often the flusher looks for other workers' spool files beside its own (`flush_others`)


class _SpoolFailed(Exception):
    """A spool call of a flush failed (its file cannot be written or read): not the ledger's failure."""


class SpoolFlush:
    """The flusher's methods of the Deliverer, which holds the state they use (spool, ledger, ledger_calls, metrics)."""

    async def flush_spool(self) -> None:
        """Write spooled records to the ledger, oldest first, while it takes them; forever, as a task. Every
        ADOPT_EVERY_S, and at the first pass, the other spool files beside this one too (`flush_others`)."""
        delay = self.flush_s
        adopted_at = -math.inf
        while True:
            await asyncio.sleep(delay)
            delay = await self.flush_once()
            if self.ledger_down is None and time.monotonic() - adopted_at >= ADOPT_EVERY_S:
                adopted_at = time.monotonic()
                await self.flush_others()

    async def flush_others(self, chunk: int = 500) -> int:
        """Flush the spool files of other workers in this spool's folder (a worker killed while the ledger was down,
        restarted under another --worker-id, would leave its records there unbilled for good), then delete them: each
        record is written once whoever flushes it (the ledger's keys), and a file is flushed and deleted only while no
        other process has it open (consumer.spool), so a worker that is alive keeps its file and flushes it itself.
        Files that are not spools, or whose records are for another ledger (Spool.existing), are left alone. Returns
        how many records went to the ledger."""
        mine = self.spool.path.resolve()
        moved = 0
        for path in sorted(self.spool.path.parent.glob("*.sqlite")):
            if path.resolve() == mine:
                continue
            try:
                other = await asyncio.to_thread(Spool.existing, path, self.spool.max_records, self.spool.ledger)
            except Exception:  # noqa: BLE001 - another worker's file (or its lock) cannot be opened: never this worker's failure
                log.exception("opening the spool %s of another worker failed; the next pass retries", path)
                continue
            if other is None:
                continue
            written = 0
            try:
                written = await self._flush_into_ledger(other, chunk)
                moved += written
                if written:
                    log.warning("flushed %d ledger records another worker left in its spool %s (%d left there)",
                                written, path, await asyncio.to_thread(len, other))
            except Exception:  # noqa: BLE001 - another worker's file: never this worker's failure
                log.exception("flushing the spool %s of another worker failed; the next pass retries", path)
            finally:
                await asyncio.to_thread(other.close)
            await self._remove_if_abandoned(path, written)
        for lock in self.spool.path.parent.glob("*.sqlite.lock"):  # of files deleted by a worker killed meanwhile
            if not lock.with_suffix("").exists() and lock.with_suffix("").resolve() != mine:
                await self._remove_if_abandoned(lock.with_suffix(""), 0)
        return moved

    async def _remove_if_abandoned(self, path, written: int) -> None:
        try:
            if await asyncio.to_thread(Spool.remove_if_abandoned, path):
                log.info("deleted the spool file %s of a worker that is gone: every record it held is in the ledger%s",
                         path, f" ({written} of them written now)" if written else "")
        except OSError as e:  # a folder this worker may read but not write: the file stays, flushed
            log.warning("cannot delete the spool file %s of a worker that is gone (%s); its records are in the ledger, "
                        "delete it by hand", path, e)

    async def _flush_into_ledger(self, spool: Spool, chunk: int) -> int:
        """Another spool's records to the ledger, oldest first, while it takes them (as `flush_once` does this
        worker's own, without its ledger-state bookkeeping); returns how many were written. A ledger failure raises."""
        written = 0
        while True:
            _, ids, records = await asyncio.to_thread(spool.oldest, chunk)
            if not ids:
                return written
            written += await self._write_run(spool, ids, records)

    async def _write_run(self, spool: Spool, ids: list[int], records: list) -> int:
        """One run of spooled records of one kind to the ledger, then out of `spool`: in one write, or record by record
        where the ledger refuses one (it goes to the DLQ, `_refused`); returns how many left the spool. A failure of
        the ledger itself (down, behind its schema) raises, with what was written already gone from the spool."""
        try:
            await self.ledger_calls(_writer(self.ledger, records[0]), records)
        except LedgerRecordError:
            for i, r in zip(ids, records):
                try:
                    await self.ledger_calls(_writer(self.ledger, r), [r])
                except LedgerRecordError as e:
                    await self._refused(r, e)
                await _remove(spool, [i])
            return len(ids)
        await _remove(spool, ids)
        return len(ids)

    async def flush_once(self, chunk: int = 500) -> float:
        """One pass over the spool; return how long to wait before the next. A spool that cannot be read or emptied (a
        file damaged past what consumer.spool sets aside, a disk error) is said and retried, never raised: raised, it
        ended the flusher task, and the worker with it. Nor is it taken for the ledger being down. Each pass ends with a
        count of the spool, off the loop: the fetch loop goes by it (`Spool.full`), with what other workers sharing
        the file put there."""
        delay = await self._flush_pass(chunk)
        self.metrics.spool_records.set(await self._spool_len())
        return delay

    async def _flush_pass(self, chunk: int) -> float:
        while True:
            try:
                _, ids, records = await asyncio.to_thread(self.spool.oldest, chunk)
                if not ids:
                    break
                await self._write_run(self.spool, ids, records)
            except _SpoolFailed as e:
                return self._flush_failed(e.__cause__ or e)
            except Exception as e:  # noqa: BLE001 - down, behind its schema, or unmapped: keep and retry
                if not isinstance(e, sqlite3.Error):
                    self._down(e)
                    self.metrics.retries.labels("ledger").inc()
                    return min(_BACKOFF_MAX_S, self.flush_s * 2)
                return self._flush_failed(e)  # `oldest`
            self.metrics.spool_records.set(self.spool.known)
        if self.flush_failing is not None:
            log.warning("the spool at %s is read and emptied again", self.spool.path)
            self.flush_failing = None
        if self.ledger_down is not None and not await self._spool_len():
            # Nothing spooled proves nothing (the spool's disk full, or another worker flushed the shared file): said
            # back only once the ledger answers. Set back here, `lorabatch_ledger_up` read 1 for 99 of 100 samples of a
            # drill with the ledger down and the spool's disk full.
            try:
                await self.ledger_calls(self.ledger.ping)
            except Exception as e:  # noqa: BLE001 - still down, behind its schema, or unmapped
                self._down(e)
                return min(_BACKOFF_MAX_S, self.flush_s * 2)
            self._up()
        if self.spool_down is not None and self.ledger_down is None:
            # No write waits on the spool now (each waiting one retries the spool itself): does its disk have space yet?
            try:
                await asyncio.to_thread(self.spool.probe)
            except Exception:  # noqa: BLE001 - still full: the next pass asks again
                pass
            else:
                self._spool_ok()
        return self.flush_s

    def _flush_failed(self, e: BaseException) -> float:
        if self.flush_failing is None:
            log.error("the spool at %s cannot be read or emptied (%s: %s); its records stay there and the flush is retried "
                      "(said once, and once when it passes)", self.spool.path, type(e).__name__, e)
        self.flush_failing = str(e)
        self.metrics.retries.labels("spool").inc()
        return min(_BACKOFF_MAX_S, self.flush_s * 2)

    async def _spool_len(self) -> int:
        """The spool's records, counted off the loop (what other workers of a shared file added is then seen by `full`);
        the last count where it cannot be counted (the failing call that finds out says why)."""
        try:
            return await asyncio.to_thread(len, self.spool)
        except Exception:  # noqa: BLE001 - a count must never end a flush
            return self.spool.known


async def _remove(spool: Spool, ids: list[int]) -> None:
    """Records written to the ledger, out of `spool`; its failure is the spool's (_SpoolFailed), not the ledger's."""
    try:
        await asyncio.to_thread(spool.remove, ids)
    except Exception as e:  # noqa: BLE001 - a full disk, a file damaged: their next flush writes them again, idempotently
        raise _SpoolFailed(str(e)) from e


def _writer(ledger, record) -> Callable[[Sequence], int]:
    if isinstance(record, UsageRecord):
        return ledger.record_usage
    if isinstance(record, BusyRecord):
        return ledger.record_busy
    assert isinstance(record, AdapterLoadRecord), type(record)
    return ledger.record_adapter_loads
