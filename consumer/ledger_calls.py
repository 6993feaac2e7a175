"""The worker's calls into the ledger database: off the event loop, on threads of their own, each bounded in time.

A database that stops answering without closing its connections (`docker pause`, a host or storage hang, a
network that drops packets) leaves a statement waiting for as long as the server is gone: no error comes, and
neither libpq nor PostgreSQL's own timeouts end the wait on the client's side. In a drill with the database's
processes stopped for a minute, the worker published nothing, logged nothing and kept `lorabatch_ledger_up` at 1:
its deliveries waited on the ledger write, and its event loop on the registry refresh (Kafka's heartbeats with it).

So a call that has not answered within `timeout_s` raises LedgerUnavailableError, as a database that refuses
connections does (the caller spools, or goes by what it knows); its thread is left to finish whenever the server
answers (every ledger write is idempotent, so a write that lands after its records were spooled adds nothing twice).
While such a call is still out, new calls fail at once rather than queue behind it: at most `threads` threads
ever wait on a hung server, and the spool's own calls (the default executor) never wait behind them. The threads are
daemons: a call hung at the worker's exit does not hold it (a ThreadPoolExecutor's threads are joined at exit).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from billing.errors import LedgerUnavailableError

T = TypeVar("T")

# A ledger write of a flush (500 rows by COPY) takes milliseconds; a call this long is waiting on a server that does not
# answer, or on a lock held for seconds (a migration): either way its records are better in the spool meanwhile.
LEDGER_CALL_TIMEOUT_S = 10.0


class LedgerCalls:
    """`threads`: the worker's ledger calls that may run at once: its delivery, GPU-time and spool-flush loops write one
    at a time each, the fetch loop looks stored answers up, and the registry refresh reads."""

    def __init__(self, timeout_s: float = LEDGER_CALL_TIMEOUT_S, threads: int = 4):
        assert timeout_s > 0 and threads >= 1, (timeout_s, threads)
        self.timeout_s = timeout_s
        self.threads = threads
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (future, fn, args); None ends a thread
        self._started = False
        self._out: list[tuple[float, Future]] = []  # (submitted at, monotonic; its future) of the calls not yet done

    def hung_for(self) -> float | None:
        """How long the oldest call still out has run, if longer than the timeout (the server does not answer)."""
        now = time.monotonic()
        self._out = [(at, f) for at, f in self._out if not f.done()]
        oldest = min((at for at, _ in self._out), default=now)
        return now - oldest if now - oldest >= self.timeout_s else None

    async def __call__(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a ledger thread; LedgerUnavailableError if it has not returned within the timeout, or at once
        while an earlier call is still out past it."""
        if (hung := self.hung_for()) is not None:
            raise LedgerUnavailableError(f"the ledger database has not answered a call for {hung:.0f} s (the server is "
                                         "paused, hung or cut off from this host, or a lock is held on its tables: see "
                                         "pg_stat_activity); check it, and that it is reachable")
        if not self._started:
            self._started = True
            for i in range(self.threads):
                threading.Thread(target=self._serve, name=f"lorabatch-ledger-{i}", daemon=True).start()
        future: Future = Future()
        self._queue.put((future, fn, args))
        self._out.append((time.monotonic(), future))
        try:
            # wrap_future's cancel on the timeout cancels a call still queued; one already running is left to finish
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise LedgerUnavailableError(
                f"the ledger database did not answer within {self.timeout_s:.0f} s (the server is paused, hung or cut off "
                "from this host, or a lock is held on its tables: see pg_stat_activity); check it, and that it is "
                "reachable") from None

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():  # timed out while queued
                continue
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 - the caller's await raises it
                future.set_exception(e)
            else:
                future.set_result(result)

    def close(self) -> None:
        """End the threads once their calls return; a call still out on a hung server is not waited for."""
        if self._started:
            for _ in range(self.threads):
                self._queue.put(None)
