"""An asyncio face for the engine: `await generate(request)` while one thread steps over everything submitted.

The engine is single-threaded, so it lives in one dedicated thread that owns it: every call goes to
that thread as a command on a queue, and the thread runs the step loop in between commands, so a
request submitted while others run joins the running batch at the next step (continuous batching
across callers). Results go back to each caller's event loop with `loop.call_soon_threadsafe`; the
event loop never blocks on the engine, so Kafka heartbeats and the like keep running.

Requests are known by (tenant_id, request_id), as in the engine: two tenants may use one request_id at once.
Cancelling the task awaiting `generate` aborts its request in the engine (the CancelledError is
re-raised, never swallowed). The engine fails a request alone when its admission, forward, sampling
or detokenizing fails (engine.engine, "Isolation", which lists the error codes). Only if a step raises
anyway (a bug outside those paths) does every request in flight fail, with code `engine_failed`
(retriable), and the loop goes on with new requests: the thread never dies of a request, and every
awaited `generate` settles (a request the engine lost track of fails with `engine_failed` too).

    async with AsyncEngine(Engine(config)) as engine:
        await engine.call(lambda e: e.register_adapter("acme/support@3", path))
        result = await engine.generate(GenerationRequest(request_id="r1", prompt="hi", adapter_key="acme/support@3", tenant_id="acme"))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Self, TypeVar

from engine.api import EngineError, GenerationRequest, GenerationResult, RequestError
from engine.engine import Engine

log = logging.getLogger("lorabatch.engine")
T = TypeVar("T")
_IDLE_WAIT_S = 0.05  # longest sleep of an idle loop between looks at the queue; commands wake it at once


class StepLoop:
    """The step loop and its awaited requests, apart from where commands come from and where results go: the
    thread of `AsyncEngine` and the process of `engine.engine_process.EngineProcess` both run it.

    Each request added carries a token of its caller's (a future here, a sequence number across processes), which
    `_settle` gets back with the result; `_abort(key, only)` aborts only while the key still holds that token.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._pending: dict[tuple[str, str], Any] = {}  # (tenant_id, request_id) -> its caller's token
        self._stop = False
        self._resident_at = -1  # the pool's l1_changes when the resident snapshot was last published

    # ---- what a host provides

    def _next_command(self, block_s: float) -> Callable[[], Any] | None:
        """The next command to run, waiting up to `block_s` for one; None when none came."""
        raise NotImplementedError

    def _settle(self, token: Any, res: GenerationResult) -> None:
        raise NotImplementedError

    def _publish_resident(self, keys: frozenset[str]) -> None:
        """The adapters in device slots changed (after a pass of the loop)."""

    def _end_of_turn(self) -> None:
        """A pass of the loop ended (the process host sends what it settled in one message)."""

    # ---- the loop

    def run(self) -> None:
        while not self._stop or self._pending:
            try:
                self._turn()
                changes = self.engine.adapters.l1_changes
                if changes != self._resident_at:  # rebuilt only when L1's keys changed: with thousands of rows, a
                    self._resident_at = changes  # rebuild every turn cost the engine thread a scan and a sort
                    self._publish_resident(frozenset(self.engine.resident_adapters()))
            except Exception as e:  # a bug in one step must not kill the loop and strand every caller
                log.exception("engine step failed; failing the %d requests in flight", len(self._pending))
                self._fail_all(EngineError(f"the engine failed while running this request ({type(e).__name__}); it was logged",
                                           code="engine_failed", retriable=True))  # fmt: skip
            self._end_of_turn()

    def _turn(self) -> None:
        """One pass of the loop: the commands queued, then a step if anything is unfinished."""
        if not self.engine.has_unfinished():
            if self._pending:  # every request added is unfinished or has its result waiting: these were lost (a bug)
                log.error("%d requests awaited but unknown to the engine; failing them", len(self._pending))
                self._fail_all(EngineError("the engine lost track of this request; it was logged", code="engine_failed", retriable=True))
            self._drain_commands(block_s=_IDLE_WAIT_S)
            return
        self._drain_commands(block_s=0.0)
        for res in self.engine.step():
            self._deliver(res)
        wait = self.engine.idle_wait_s()  # > 0 when nothing could run (e.g. adapter loads rate-limited)
        if wait > 0:
            self._drain_commands(block_s=min(wait, _IDLE_WAIT_S))

    def _drain_commands(self, block_s: float) -> None:
        command = self._next_command(block_s)
        while command is not None and not self._stop_now():
            command()
            command = self._next_command(0.0)

    def _stop_now(self) -> bool:
        """Whether to stop reading commands at once (the process host: its parent is gone)."""
        return False

    def _add(self, req: GenerationRequest, token: Any) -> None:
        key = (req.tenant_id, req.request_id)
        if key in self._pending:
            dup = RequestError(f"request_id {req.request_id!r} of tenant {req.tenant_id!r} is already in flight; use unique ids "
                               "per tenant", code="duplicate_request_id")  # fmt: skip
            self._settle(token, GenerationResult(request_id=req.request_id, adapter_key=req.adapter_key, tenant_id=req.tenant_id, error=dup))
            return
        self._pending[key] = token
        try:
            self.engine.add_request(req)  # (fails the request into its results rather than raising)
        except Exception as e:
            log.exception("adding request %r raised", key)
            error = EngineError(f"admitting the request raised {type(e).__name__}; it was logged", code="admission_failed")
            self._deliver(GenerationResult(request_id=req.request_id, adapter_key=req.adapter_key, tenant_id=req.tenant_id, error=error))

    def _abort(self, key: tuple[str, str], only: Any = None) -> GenerationResult | None:
        """Abort the request `key`; with `only`, only while it is still the request that token's caller added."""
        if only is not None and self._pending.get(key, None) != only:
            return None  # the request already finished, or the id now belongs to a newer request
        tenant_id, request_id = key
        res = self.engine.abort(request_id, tenant_id)
        if res is not None:
            self._deliver(res)
        return res

    def _fail_all(self, error: EngineError) -> None:
        """Fail every request in the engine and every caller waiting with `error` (results already made are delivered
        as they are)."""
        try:
            results = self.engine.abort_all(error)
        except Exception:
            log.exception("could not abort the requests in flight after an engine failure")
            results = []
        for res in results:
            self._deliver(res)
        for tenant_id, request_id in list(self._pending):
            self._deliver(GenerationResult(request_id=request_id, adapter_key=None, tenant_id=tenant_id, error=error))

    def _deliver(self, res: GenerationResult) -> None:
        token = self._pending.pop((res.tenant_id, res.request_id), None)
        if token is None:
            log.warning("result for %r of tenant %r, which no caller awaits", res.request_id, res.tenant_id)
            return
        self._settle(token, res)

    def _request_stop(self) -> None:
        self._stop = True


class AsyncEngine(StepLoop):
    def __init__(self, engine: Engine):
        super().__init__(engine)
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # The adapters in device slots, as the engine thread last saw them (after each pass of its loop). Other
        # threads read this snapshot instead of calling the engine while it steps: rebinding it is atomic.
        self._resident: frozenset[str] = frozenset()
        # Measured time of results that reached no caller (its generate was cancelled first): busy time no usage row
        # bills. Touched on the callers' event loop only.
        self._unbilled_us = 0

    @property
    def config(self):
        return self.engine.config

    # ---- lifecycle

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self.run, name="lorabatch-engine", daemon=True)
        self._thread.start()

    @property
    def resident(self) -> frozenset[str]:
        """Keys of the adapters in device slots at the end of the engine thread's last pass (steps, commands):
        at most one pass (a step, or _IDLE_WAIT_S idle) old; safe to read from any thread."""
        return self._resident

    @property
    def alive(self) -> bool:
        """Whether the step loop runs; False once closed, or if it died (a bug: callers should stop)."""
        thread = self._thread  # read once: /readyz asks from its own thread while a close on the loop sets it to None
        return thread is not None and thread.is_alive()

    async def close(self, *, drain: bool = True) -> None:
        """Stop the step loop: after the requests in flight finish (drain), or aborting them."""
        if self._thread is None:
            return
        if not drain:
            await self.call(lambda e: self._fail_all(RequestError("the engine is closing", code="aborted")))
        self._commands.put((self._request_stop, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self.engine.adapters.close()  # the reader processes, if any (engine.adapter_reader)

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(drain=exc[0] is None)

    # ---- requests

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run one request to completion among everything else submitted; cancelling aborts it."""
        assert self._thread is not None, "start() first"
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        self._commands.put((lambda: self._add(req, fut), None))
        try:
            return await fut
        except asyncio.CancelledError:
            self._commands.put((lambda: self._abort((req.tenant_id, req.request_id), fut), None))
            raise

    async def abort(self, request_id: str, tenant_id: str = "") -> GenerationResult | None:
        """Abort the request (tenant_id, request_id) in flight; its `generate` returns the partial result (code `aborted`)."""
        return await self.call(lambda e: self._abort((tenant_id, request_id)))

    async def stats(self) -> dict:
        return await self.call(lambda e: e.stats())

    async def pop_gpu_time(self) -> tuple[list, int, int, datetime, int]:
        """The engine's adapter load events, its steps' measured busy µs and their count since the last call, the
        wall clock read between the same two steps (every step counted began after the previous call and ended
        before this clock), and the µs charged to results that reached no caller since the last call."""
        loads, busy_us, steps, clock = await self.call(_pop_gpu_time)
        unbilled, self._unbilled_us = self._unbilled_us, 0
        return loads, busy_us, steps, clock, unbilled

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` in the engine thread between steps (register_adapter, load_adapter, pop_load_events, ...)."""
        assert self._thread is not None, "start() first"
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((lambda: fn(self.engine), done))
        return await asyncio.wrap_future(done)

    # ---- the engine thread (StepLoop's host)

    def _next_command(self, block_s: float) -> Callable[[], Any] | None:
        try:
            fn, done = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return None
        return lambda: self._run_command(fn, done)

    def _publish_resident(self, keys: frozenset[str]) -> None:
        self._resident = keys

    def _settle(self, token: asyncio.Future, res: GenerationResult) -> None:
        token.get_loop().call_soon_threadsafe(self._settle_on_loop, token, res)

    def _settle_on_loop(self, fut: asyncio.Future, res: GenerationResult) -> None:
        if fut.done():  # cancelled meanwhile: nobody bills what it ran
            self._unbilled_us += charged_us(res)
        else:
            fut.set_result(res)

    def _run_command(self, fn: Callable[[], Any], done: concurrent.futures.Future | None) -> None:
        # A caller cancelled before its command ran (a task cancelled at shutdown) gets nothing run for it;
        # once running, the future can no longer be cancelled, so setting its result below is safe.
        if done is not None and not done.set_running_or_notify_cancel():
            return
        try:
            value = fn()
        except BaseException as e:  # handed to the caller; nothing is swallowed
            if done is None:
                log.exception("engine command failed")
            else:
                done.set_exception(e)
            return
        if done is not None:
            done.set_result(value)


def _pop_gpu_time(e: Engine) -> tuple[list, int, int, datetime]:
    steps = e.pop_step_records()
    return e.pop_load_events(), sum(r.total_us for r in steps), len(steps), datetime.now(UTC)


def charged_us(res: GenerationResult) -> int:
    """The measured GPU time a result carries: its shares of the steps it ran in (what its usage row bills)."""
    return res.timings.base_us + res.timings.lora_us
