"""Waiting for a dependency: try, and on failure wait with capped doubling backoff, one log line per try.

A worker started before its broker, its ledger or its Redis (or whose broker died) waits for it rather
than exiting with a traceback: each failed attempt logs what is waited for, why the attempt failed and
when the next one comes (0.5 s, 1 s, 2 s, ... up to `max_s`, so a long outage logs about twice a minute).
A stop request (SIGTERM) ends the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar
from urllib.parse import urlsplit

from consumer.config import ConfigError, Settings

log = logging.getLogger("lorabatch.worker")

T = TypeVar("T")


class Stopped(Exception):
    """The wait ended because the process was asked to stop."""

    retriable = False


async def wait_for(what: str, attempt: Callable[[], Awaitable[T]], *, stopping: asyncio.Event | None = None,
                   first_s: float = 0.5, max_s: float = 30.0, give_up_s: float | None = None,
                   hint: str = "", explain: Callable[[], Awaitable[str]] | None = None,
                   retry: tuple[type[Exception], ...] = (Exception,)) -> T:
    """`await attempt()` until it returns. Raises Stopped when `stopping` is set first, and the last error
    once `give_up_s` has passed (None: never gives up). `explain()`: a line on what holds an attempt that runs long,
    added to the log's "still waiting" line. An error that is none of `retry` is raised at once."""
    assert first_s > 0 and max_s > 0, (first_s, max_s)
    started = time.monotonic()
    delay = min(first_s, max_s)
    tries = 0
    while True:
        if stopping is not None and stopping.is_set():
            raise Stopped(f"stopped while waiting for {what}")
        tries += 1
        try:
            value = await _unless_stopped(attempt(), stopping, what, explain)
        except (asyncio.CancelledError, Stopped, ConfigError):  # a mistake in the configuration: no wait mends it
            raise
        except retry as e:  # any failure of the dependency (by default) is waited out, and said
            waited = time.monotonic() - started
            if give_up_s is not None and waited + delay > give_up_s:
                log.warning("gave up waiting for %s after %.0fs and %d attempts (%s)", what, waited, tries, _brief(e))
                raise
            log.warning("waiting for %s: attempt %d failed (%s)%s; next attempt in %.1fs", what, tries, _brief(e),
                        f"; {hint}" if hint else "", delay)
            if stopping is None:
                await asyncio.sleep(delay)
            else:
                try:
                    await asyncio.wait_for(stopping.wait(), timeout=delay)
                except TimeoutError:
                    pass
            delay = min(delay * 2, max_s)
            continue
        if tries > 1:
            log.warning("%s is available after %.1fs and %d attempts", what, time.monotonic() - started, tries)
        return value


STOP_GRACE_S = 10.0  # an attempt cancelled by a stop gets this long to clean up (a client's stop) before it is left
SLOW_ATTEMPT_S = 30.0  # an attempt running this long is said in the log, and again each time as long again
EXPLAIN_S = 6.0  # the most a slow attempt's `explain` may take (a broker that answers slowly: the line goes without it)


async def _unless_stopped(attempt: Awaitable[T], stopping: asyncio.Event | None, what: str,
                          explain: Callable[[], Awaitable[str]] | None = None) -> T:
    """The attempt's value; Stopped, the attempt cancelled, when `stopping` is set while it runs. A Kafka consumer's
    start joins its group and can hang there (a coordinator waiting on a member that is gone), so a SIGTERM must
    end the attempt itself, not only the wait between attempts."""
    if stopping is None:
        return await attempt
    task = asyncio.ensure_future(attempt)
    stop = asyncio.ensure_future(stopping.wait())
    started = time.monotonic()
    try:
        why = (" (a Kafka consumer joining its group waits for the group's members; one that died holds it until its "
               "session times out)") if "Kafka" in what else ""
        while not (await asyncio.wait({task, stop}, timeout=SLOW_ATTEMPT_S, return_when=asyncio.FIRST_COMPLETED))[0]:
            log.warning("still waiting for %s: its attempt has run %.0f s%s%s; SIGTERM stops the wait", what,
                        time.monotonic() - started, why, await _explained(explain))
    finally:
        stop.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_GRACE_S)
    if task.cancelled() or not task.done():  # (not done: it ignored the cancel for the whole grace, and is left)
        raise Stopped(f"stopped while waiting for {what}")
    return task.result()


async def _explained(explain: Callable[[], Awaitable[str]] | None) -> str:
    """"; " and `explain()`'s line, or "" when there is none or it fails: the wait goes on either way."""
    if explain is None:
        return ""
    try:
        return "; " + await asyncio.wait_for(explain(), EXPLAIN_S)
    except Exception as e:  # noqa: BLE001 - a line for the log: its failure is said in it, never raised
        return f"; (what holds it could not be read: {_brief(e)})"


def _brief(e: BaseException) -> str:
    """The error in one short line: its type and the first line of its message."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


async def connect(make: Callable[[], T], settings: Settings, stopping: asyncio.Event | None = None,
                  explain: Callable[[], Awaitable[str]] | None = None) -> T:
    """A started Kafka client (producer, consumer); a fresh one per attempt while the broker cannot be reached.
    `explain`: what holds a start that runs long (a consumer's: the group's members), for the log."""
    async def attempt():
        client = make()
        try:
            await client.start()
        except BaseException:
            with contextlib.suppress(Exception):  # a stop that would leave a hung group join is itself bounded
                await asyncio.wait_for(client.stop(), STOP_GRACE_S / 2)
            raise
        return client

    return await wait_for(f"the Kafka broker at {settings.kafka.bootstrap_servers}", attempt, stopping=stopping,
                          max_s=settings.worker.wait_max_s,
                          hint="start it (`lorabatch broker start`) or set kafka.bootstrap_servers to a running cluster",
                          explain=explain)


async def wait_for_redis(cache, settings: Settings, stopping: asyncio.Event | None = None) -> None:
    """Redis holds the L1/L2 route maps: wait for it up to routing.redis_start_wait_s at start, then route
    without it (the tenants' rules and defaults) until it answers."""
    if getattr(cache, "name", None) != "redis":
        return
    url = urlsplit(settings.routing.redis_url)
    where = url._replace(netloc=url.netloc.rsplit("@", 1)[-1], query="").geturl()  # no password in the log
    from redis.exceptions import AuthenticationError, NoPermissionError

    from consumer.route_cache import explain

    async def ping():  # a refusal (a password or ACL the worker lacks) is no outage: waiting cannot end it
        try:
            return await cache.client.ping()
        except (AuthenticationError, NoPermissionError) as e:
            return e

    try:
        answer = await wait_for(f"Redis at {where}", ping, stopping=stopping, max_s=settings.worker.wait_max_s,
                                give_up_s=settings.routing.redis_start_wait_s, hint="start it or fix routing.redis_url")
    except Stopped:
        raise
    except Exception:  # noqa: BLE001 - Redis speeds routing up; without it routing goes on
        log.warning("starting without Redis: routing uses the tenants' rules and defaults until it answers")
        return
    if isinstance(answer, Exception):
        log.error("Redis at %s refuses the worker (%s); starting without it: routing uses the tenants' rules and defaults "
                  "until it accepts", where, explain(answer))


async def wait_for_ledger(settings: Settings, stopping: asyncio.Event | None = None):
    """The opened services (consumer.services.Services) once the ledger database answers and its schema is
    current; waited for while it is down or not yet migrated."""
    from consumer.services import open_services, shown_url

    return await wait_for(f"the ledger database {shown_url(settings.ledger.url)}",
                          lambda: asyncio.to_thread(open_services, settings), stopping=stopping,
                          max_s=settings.worker.wait_max_s,
                          hint="start it, fix ledger.url, or run `lorabatch db upgrade` if its schema is missing")
