"""consumer.ledger_calls: the worker's calls into a ledger database that may stop answering without an error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from billing.errors import LedgerUnavailableError
from consumer.ledger_calls import LedgerCalls


async def test_a_call_that_does_not_answer_fails_as_the_ledger_down_and_holds_no_more_threads():
    """A call past the timeout raises LedgerUnavailableError (the caller spools); while it is still out, new calls fail
    at once instead of queueing behind it; once it returns, calls go through again, and the late call's own work was
    done (a write that lands after its records were spooled: the ledger's keys make it land once)."""
    calls = LedgerCalls(timeout_s=0.2, threads=1)
    server = threading.Event()
    done = []

    def hung_write():
        server.wait(30)
        done.append("written")
        return 1

    try:
        assert await calls(lambda x: x + 1, 1) == 2
        with pytest.raises(LedgerUnavailableError, match="did not answer within"):
            await calls(hung_write)
        with pytest.raises(LedgerUnavailableError, match="has not answered a call for"):
            await calls(lambda: 3)
        server.set()
        while calls.hung_for() is not None:
            await asyncio.sleep(0.01)
        assert await calls(lambda: 3) == 3 and done == ["written"]
        with pytest.raises(ZeroDivisionError):  # the ledger's own errors come through as they are
            await calls(lambda: 1 / 0)
    finally:
        server.set()
        calls.close()
