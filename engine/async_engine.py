"""An asyncio face for the engine: `await generate(request)` while one thread steps over everything submitted.

The engine is single-threaded, so it lives in one dedicated thread that owns it: every call goes to
that thread as a command on a queue, and the thread runs the step loop in between commands, so a
request submitted while others run joins the running batch at the next step (continuous batching
across callers). Results go back to each caller's event loop with `loop.call_soon_threadsafe`; the
event loop never blocks on the engine, so Kafka heartbeats and the like keep running.

Cancelling the task awaiting `generate` aborts its request in the engine (the CancelledError is
re-raised, never swallowed). If a step raises (a bug, an out-of-memory), every request in flight fails
with code `engine_failed` (retriable) and is aborted, and the loop goes on with new requests.

    async with AsyncEngine(Engine(config)) as engine:
        await engine.call(lambda e: e.register_adapter("acme/support@3", path))
        result = await engine.generate(GenerationRequest(request_id="r1", prompt="hi", adapter="acme/support@3"))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any, Self, TypeVar

from engine.api import EngineError, GenerationRequest, GenerationResult, RequestError
from engine.engine import Engine

log = logging.getLogger("lorabatch.engine")
T = TypeVar("T")
_IDLE_WAIT_S = 0.05  # longest sleep of an idle loop between looks at the queue; commands wake it at once


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future | None]] = queue.SimpleQueue()
        self._pending: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._stop = False

    # ---- lifecycle

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._loop, name="lorabatch-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the step loop runs; False once closed, or if it died (a bug: callers should stop)."""
        return self._thread is not None and self._thread.is_alive()

    async def close(self, *, drain: bool = True) -> None:
        """Stop the step loop: after the requests in flight finish (drain), or aborting them."""
        if self._thread is None:
            return
        if not drain:
            await self.call(lambda e: self._abort_all(RequestError("the engine is closing", code="aborted")))
        self._commands.put((self._request_stop, None))
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    async def __aenter__(self) -> Self:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(drain=exc[0] is None)

    # ---- requests

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run one request to completion among everything else submitted; cancelling aborts it."""
        assert self._thread is not None, "start() first"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[GenerationResult] = loop.create_future()
        self._commands.put((lambda: self._add(req, loop, fut), None))
        try:
            return await fut
        except asyncio.CancelledError:
            self._commands.put((lambda: self._abort(req.request_id, fut), None))
            raise

    async def abort(self, request_id: str) -> GenerationResult | None:
        """Abort a request in flight; its `generate` returns the partial result (code `aborted`)."""
        return await self.call(lambda e: self._abort(request_id, None))

    async def stats(self) -> dict:
        return await self.call(lambda e: e.stats())

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` in the engine thread between steps (register_adapter, load_adapter, pop_load_events, ...)."""
        assert self._thread is not None, "start() first"
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put((lambda: fn(self.engine), done))
        return await asyncio.wrap_future(done)

    # ---- the engine thread

    def _loop(self) -> None:
        while not self._stop or self._pending:
            if not self.engine.has_unfinished():
                self._drain_commands(block_s=_IDLE_WAIT_S)
                continue
            self._drain_commands(block_s=0.0)
            try:
                results = self.engine.step()
            except Exception as e:  # a bug or an OOM in one step must not kill the thread and strand every caller
                log.exception("engine step failed; failing the %d requests in flight", len(self._pending))
                self._abort_all(EngineError(f"the engine failed while running this request ({type(e).__name__}); it was logged",
                                            code="engine_failed", retriable=True))
                continue
            for res in results:
                self._deliver(res)
            wait = self.engine.idle_wait_s()  # > 0 when nothing could run (e.g. adapter loads rate-limited)
            if wait > 0:
                self._drain_commands(block_s=min(wait, _IDLE_WAIT_S))

    def _drain_commands(self, block_s: float) -> None:
        try:
            command = self._commands.get(timeout=block_s) if block_s > 0 else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._run_command(*command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

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

    def _add(self, req: GenerationRequest, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        if req.request_id in self._pending:
            dup = RequestError(f"request_id {req.request_id!r} is already in flight; use unique ids", code="duplicate_request_id")
            loop.call_soon_threadsafe(_settle, fut, GenerationResult(request_id=req.request_id, adapter=req.adapter, error=dup))
            return
        self._pending[req.request_id] = (loop, fut)
        self.engine.add_request(req)

    def _abort(self, request_id: str, only: asyncio.Future | None) -> GenerationResult | None:
        entry = self._pending.get(request_id)
        if only is not None and (entry is None or entry[1] is not only):
            return None  # the request already finished, or the id now belongs to a newer request
        res = self.engine.abort(request_id)
        if res is not None:
            self._deliver(res)
        return res

    def _abort_all(self, error: EngineError) -> None:
        for request_id in list(self._pending):
            try:
                res = self.engine.abort(request_id)
            except Exception:
                log.exception("could not abort %r after an engine failure", request_id)
                res = None
            if res is None:
                res = GenerationResult(request_id=request_id, adapter=None)
            res.error = error
            self._deliver(res)

    def _deliver(self, res: GenerationResult) -> None:
        entry = self._pending.pop(res.request_id, None)
        if entry is None:
            log.warning("result for %r, which no caller awaits", res.request_id)
            return
        loop, fut = entry
        loop.call_soon_threadsafe(_settle, fut, res)

    def _request_stop(self) -> None:
        self._stop = True


def _settle(fut: asyncio.Future, res: GenerationResult) -> None:
    if not fut.done():  # cancelled meanwhile
        fut.set_result(res)
