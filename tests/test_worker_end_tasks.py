"""The worker's tasks end at its stop even when one swallows its cancellation (consumer.worker `end_tasks`): before
Python 3.12, `asyncio.wait_for` returns the inner result when the inner future completes as its caller is cancelled,
and a loop around it goes on; a full run once hung a worker's stop so, on its gpu-time loop."""

from __future__ import annotations

import asyncio
import logging

from consumer.worker import end_tasks


async def test_a_task_that_swallows_its_cancellation_is_cancelled_again():
    swallowed = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(True)  # as a wait_for whose inner future completed at the cancel: the loop goes on

    async def plain() -> None:
        await asyncio.sleep(3600)

    async def failed() -> None:
        raise ValueError("boom")

    tasks = [asyncio.create_task(stubborn(), name="stubborn"), asyncio.create_task(plain(), name="plain"),
             asyncio.create_task(failed(), name="failed")]  # fmt: skip
    await asyncio.sleep(0)
    await asyncio.wait_for(end_tasks(tasks, wait_s=0.05), timeout=10)
    assert all(t.done() for t in tasks) and swallowed == [True]


async def test_a_task_that_never_ends_is_left_and_logged(caplog):
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                pass

    task = asyncio.create_task(deaf(), name="deaf")
    await asyncio.sleep(0)
    with caplog.at_level(logging.ERROR, logger="lorabatch.worker"):
        await asyncio.wait_for(end_tasks([task], wait_s=0.01, rounds=3), timeout=10)
    assert not task.done() and "deaf did not end when cancelled 3 times" in caplog.text
    release.set()
    task.cancel()
    await asyncio.wait_for(task, timeout=10)


async def test_wait_for_swallowing_a_cancellation_is_what_it_guards_against():
    """Where this Python's wait_for swallows a cancel that comes as its inner future completes, the loop around it goes
    on until end_tasks cancels it again; where it does not (3.12 and later), the first cancel ends it."""
    loop = asyncio.get_running_loop()
    inner: list[asyncio.Future] = []
    turns = []

    async def polling() -> None:
        while True:
            fut = loop.create_future()
            inner.append(fut)
            await asyncio.wait_for(fut, timeout=3600)
            turns.append(1)

    task = asyncio.create_task(polling(), name="polling")
    await asyncio.sleep(0)
    inner[-1].set_result(None)  # the inner future completes ...
    task.cancel()  # ... and the caller is cancelled before it resumes
    await asyncio.wait_for(end_tasks([task], wait_s=0.05), timeout=10)
    assert task.done()
