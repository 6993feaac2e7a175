"""The engine in a process of its own, so that no Python of the worker shares the step loop's interpreter lock.

Measured on the H200 (engine/PERF.md, "the service against the engine alone"): with the step loop on a thread of the
worker, llama-1b steps took 40% longer than the same steps of the engine alone (15.4 against 10.9 ms), and the service
ran at 0.64x the engine. A step is launch-bound host Python; whenever the event loop (fetching, parsing, publishing)
or a ledger write holds the lock, the step's launches wait. Here a spawned child builds `Engine(config)` and runs the
same `StepLoop` as `AsyncEngine`'s thread, with commands and results as pickled messages over two pipes.

`EngineProcess` has AsyncEngine's face (generate, abort, stats, call, resident, alive, close, config), except:
- `call(fn)` pickles `fn`: a module-level function or a `functools.partial` of one, not a lambda or a closure; an
  unpicklable `fn` raises in the caller and the engine never sees it;
- `start()` blocks until the child has built its engine; `config` is then the child's, with the sizes it derived
  for its device (engine.sizing).

Messages keep their order (one pipe each way), so a request added after another's abort finds it gone, as on the thread.
A pass's results travel in one message. If the child dies (a CUDA crash, the OOM killer), every awaited `generate`
returns `engine_failed` (retriable) and every awaited `call` raises it, `alive` turns False, and later calls fail the
same way at once until `restart`. The child exits when its parent goes away: a killed worker's child holds no GPU.

The child's switch interval is GIL_SWITCH_S, not Python's 5 ms, so that its adapter read-ahead threads take the lock
while the step loop waits, not mid-launch (engine/PERF.md, session 16: a 2,000-adapter cold pass 4.58 s against 4.99).

    engine = EngineProcess(config)
    engine.start()  # blocks while the child loads the model
    async with engine:
        result = await engine.generate(GenerationRequest(request_id="r1", prompt="hi", tenant_id="acme"))
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.util
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Self, TypeVar

from engine.api import EngineError, GenerationRequest, GenerationResult, RequestError
from engine.async_engine import StepLoop, charged_us
from engine.collector import freeze, hold_full_passes
from engine.config import EngineConfig
from engine.host_arena import reap, release_segments

log = logging.getLogger("lorabatch.engine")
GIL_SWITCH_S = 0.05  # the child's sys.setswitchinterval: how long another thread waits before the step loop must yield
T = TypeVar("T")
_START_POLL_S = 0.5  # how often start() looks whether a child that has not answered yet is still alive
_KILL_GRACE_S = 5.0  # how long a close with a deadline waits for a killed child to exit


class EngineProcess:
    def __init__(self, config: EngineConfig, *, initializer: Callable[[], None] | None = None):
        """`initializer` runs first in the child (logging set-up, say); it is pickled, as `call`'s functions are."""
        self._start_config = config
        self._initializer = initializer
        self.config: EngineConfig | None = None  # the child's, once started
        self.pid: int | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._to_child = None  # Connection: commands, written by the sender thread only
        self._from_child = None  # Connection: results and replies, read by the reader thread only
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # the maps below: callers add on their loops, the reader settles
        self._requests: dict[int, tuple[tuple[str, str], asyncio.Future]] = {}  # seq -> (key, its generate's future)
        self._calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._resident: frozenset[str] = frozenset()
        # The steps' busy time and adapter load events arrive with the results of the pass that made them (see
        # pop_gpu_time). Sums, not the step records: each holds a share per row (256 at a GPU's batch), and pickling
        # them took about 1 ms a step (here, on a loaded 2-core machine) on the step loop's path.
        self._busy: tuple[int, int] = (0, 0)  # (µs, steps)
        # Busy time no usage row will bill (pop_gpu_time): results that reached no caller, and at the child's death the
        # shares its unanswered requests had taken. The child's lifetime sums give the latter exactly: every step's
        # time is split over its requests, and every step of an answered request came before or with its answer.
        self._unbilled_us = 0
        self._life: tuple[int, int] = (0, 0)  # (busy µs received, µs charged to the results received) of this child
        self._loads: list = []
        self._clock: datetime | None = None  # the child's wall clock when it sent the last of them
        self._stopping = False
        self._dead: EngineError | None = None  # set once the child is gone: every later call fails with it
        self._starting: asyncio.Future | None = None  # a restart's start, running in a thread
        self._abandon = threading.Event()  # that start's: set by a close that will not wait for it (see start)
        self._start_lock = threading.Lock()

    # ---- lifecycle

    @property
    def started(self) -> bool:
        return self._proc is not None

    def start(self, abandon: threading.Event | None = None) -> None:
        """Spawn the child and wait until its engine is built; raises what building it raised. `abandon` (a restart's):
        once set, the start kills the child it made and raises, unless it had published it already."""
        assert self._proc is None, "already started"
        abandon = abandon or threading.Event()
        ctx = multiprocessing.get_context("spawn")  # a fork would copy a CUDA context (and the parent's threads)
        cmd_read, cmd_write = ctx.Pipe(duplex=False)
        res_read, res_write = ctx.Pipe(duplex=False)
        # Not a daemon: the engine starts reader processes of its own (engine.adapter_reader), which a daemon may not.
        proc = ctx.Process(target=_child_main, args=(self._start_config, cmd_read, res_write, self._initializer),
                           name="lorabatch-engine", daemon=False)
        proc.start()
        cmd_read.close()  # the child's ends: closed here, so that each side sees EOF when the other is gone
        res_write.close()
        log.info("engine process %d building its engine on %s", proc.pid, self._start_config.device)
        while not res_read.poll(_START_POLL_S):
            if abandon.is_set():
                _abandoned(proc)
            if not proc.is_alive():
                proc.join()
                raise EngineError(f"the engine process exited with code {proc.exitcode} while building its engine; "
                                  "its log above says why", code="engine_failed")  # fmt: skip
        try:
            kind, value = pickle.loads(res_read.recv_bytes())
        except (EOFError, OSError) as e:
            proc.join()
            raise EngineError(f"the engine process exited with code {proc.exitcode} while building its engine",
                              code="engine_failed") from e  # fmt: skip
        if kind == "failed":
            proc.join()
            raise value
        with self._start_lock:  # a close abandons under it: the child is either published or killed, never both
            if abandon.is_set():
                _abandoned(proc)
            (self.config, self._clock), self.pid = value, proc.pid
            self._proc, self._to_child, self._from_child = proc, cmd_write, res_read
            self._life = (0, 0)
            self._threads = [threading.Thread(target=self._send_loop, name="lorabatch-engine-send", daemon=True),
                             threading.Thread(target=self._read_loop, name="lorabatch-engine-read", daemon=True)]
            for t in self._threads:
                t.start()
        # At interpreter exit, multiprocessing joins its non-daemon children: a parent that never closed this one would
        # wait forever for a child that waits for commands. Closing the command pipe first (a finalizer runs before
        # that join) lets the child see its parent go, abort what it runs and exit.
        multiprocessing.util.Finalize(self, cmd_write.close, exitpriority=100)

    @property
    def resident(self) -> frozenset[str]:
        """Keys of the adapters in device slots as the child last reported them (after a pass of its loop that
        changed them); safe to read from any thread."""
        return self._resident

    @property
    def alive(self) -> bool:
        """Whether the child runs and answers (its handle read once: /readyz asks while a close clears it)."""
        return (proc := self._proc) is not None and self._dead is None and proc.is_alive()

    @property
    def died(self) -> bool:
        """Whether the child died (not closed): `restart()` starts another."""
        return self._dead is not None and self._dead.code == "engine_failed"

    async def close(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop the child: after the requests in flight finish (drain), or aborting them; then wait for it to exit.
        With `timeout_s`, a child that has not exited that long after the close began (a hung GPU, a step that never
        ends) is killed, and one the kill does not end within _KILL_GRACE_S (stuck in the kernel) is left behind,
        logged: a worker's stop must end within its grace period."""
        loop = asyncio.get_running_loop()
        until = None if timeout_s is None else loop.time() + timeout_s
        if self._starting is not None:  # a restart's start, still in its thread: close what it makes
            starting, self._starting = self._starting, None
            try:
                await asyncio.wait_for(asyncio.shield(starting), _left(loop, until))
            except (TimeoutError, asyncio.CancelledError) as e:  # the start kills what it made and raises
                with self._start_lock:
                    self._abandon.set()
                    published = self._proc is not None  # it came through just before: closed below (killed, if cancelled)
                starting.add_done_callback(_retrieve)
                if isinstance(e, asyncio.CancelledError):
                    if published:
                        self._stopping = True
                        self._proc.kill()
                    raise
                if not published:
                    log.error("the engine process did not start within %g s of the close; its start is abandoned", timeout_s)
                    return
            except Exception:  # noqa: BLE001  (the restart that awaited it says why)
                return
        if self._proc is None:
            return
        try:
            if self._dead is None:
                if not drain:
                    await asyncio.wait_for(self._ask(lambda cid: ("fail_all", cid)), _left(loop, until))
                self._stopping = True
                self._post(("stop",))
            # Its sentinel, not join's answer: the reader thread may be reaping it at the same time, and then a join
            # here returns at once with no exit code.
            if not await asyncio.to_thread(multiprocessing.connection.wait, [self._proc.sentinel], _left(loop, until)):
                raise TimeoutError
        except TimeoutError:
            log.error("the engine process %d did not stop within %g s of the close; killing it", self._proc.pid, timeout_s)
            self._stopping = True
            self._proc.kill()
        except EngineError:  # it died meanwhile: only the reaping below is left
            pass
        grace = None if timeout_s is None else _KILL_GRACE_S
        if not await asyncio.to_thread(multiprocessing.connection.wait, [self._proc.sentinel], grace):
            log.error("the engine process %d has not exited %g s after SIGKILL (stuck in the kernel: a driver call?); "
                      "leaving it", self._proc.pid, grace)
            # At exit multiprocessing joins the children it started, which would wait for this one forever; the
            # handle stays closed (a later start would find a GPU that a stuck child may still hold).
            multiprocessing.process._children.discard(self._proc)  # no public way to let go of a child
            with self._lock:
                self._dead = self._dead or EngineError("the engine is closed", code="aborted")
            self._proc = None
            return
        await asyncio.to_thread(self._proc.join)
        self._outbox.put(None)  # the sender's end
        for t in self._threads:
            await asyncio.to_thread(t.join)
        self._to_child.close()
        self._from_child.close()
        self._proc = None

    async def restart(self) -> None:
        """After the child died: reap it and start a fresh one on the same config (its adapters are registered
        again by whoever registered them: the new child knows none). A caller cancelled while the child builds its
        engine leaves the start to `close`, which waits for it and stops what it made."""
        assert self._dead is not None and self._dead.code == "engine_failed", "restart() is for a child that died"
        await self.close()
        self._outbox, self._resident, self._stopping, self._dead = queue.SimpleQueue(), frozenset(), False, None
        self._abandon = threading.Event()
        self._starting = asyncio.ensure_future(asyncio.to_thread(self.start, self._abandon))
        try:
            await asyncio.shield(self._starting)
        finally:
            if self._starting is not None and self._starting.done():
                self._starting = None

    def kill(self) -> None:
        """Kill the child at once (a test's crash; shutdown uses close)."""
        if self._proc is not None:
            self._proc.kill()

    async def __aenter__(self) -> Self:
        if not self.started:
            self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close(drain=exc[0] is None)

    # ---- requests

    async def generate(self, req: GenerationRequest) -> GenerationResult:
        """Run one request to completion in the child among everything else submitted; cancelling aborts it."""
        assert self._proc is not None, "start() first"
        fut: asyncio.Future[GenerationResult] = asyncio.get_running_loop().create_future()
        key = (req.tenant_id, req.request_id)
        with self._lock:
            if self._dead is not None:
                return GenerationResult(request_id=req.request_id, adapter_key=req.adapter_key, tenant_id=req.tenant_id,
                                        error=self._dead)  # fmt: skip
            seq = next(self._ids)
            self._requests[seq] = (key, fut)
        try:
            self._post(("add", seq, req))
        except BaseException:  # it does not pickle: never sent, never counted
            with self._lock:
                self._requests.pop(seq, None)
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            if self._dead is None:
                self._post(("abort", 0, key, seq))  # only while the key is still this request's
            raise

    async def abort(self, request_id: str, tenant_id: str = "") -> GenerationResult | None:
        """Abort the request (tenant_id, request_id) in flight; its `generate` returns the partial result (code `aborted`)."""
        return await self._ask(lambda cid: ("abort", cid, (tenant_id, request_id), None))

    async def stats(self) -> dict:
        return await self.call(_stats)

    async def pop_gpu_time(self) -> tuple[list, int, int, datetime, int]:
        """The adapter load events, the steps' measured busy µs and their count received since the last call, the
        child's wall clock at the end of the pass that sent the last of them (every step popped ended before it, and
        every step not yet popped began after it, but for the decode round the child leaves running, which began on
        the device as the one before it ended, a read-back's host time at most before the clock: `Engine.
        pop_step_records`, drain=False; a clock read here could fall inside a step the child is running), and the busy
        µs since the last call that no result a caller received carries.

        They come with the results of the pass of the child's loop that made them, in one message: every result
        received has its steps here. A child that dies takes with it only the steps of its last pass; the time its
        unanswered requests took in the steps received is the unbilled µs (they are answered engine_failed, with no
        time charged), as is the time of results whose caller had gone (a cancelled generate)."""
        with self._lock:
            loads, self._loads = self._loads, []
            busy_us, steps, self._busy = *self._busy, (0, 0)
            unbilled, self._unbilled_us = self._unbilled_us, 0
            return loads, busy_us, steps, self._clock, unbilled

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` in the child between steps; `fn` must pickle (a module-level function or a partial of one)."""
        try:
            pickle.dumps(fn)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"EngineProcess.call needs a function that pickles (a module-level function or a "
                            f"functools.partial of one), not {fn!r}: {e}") from e  # fmt: skip
        return await self._ask(lambda cid: ("call", cid, fn))

    # ---- the parent's threads

    async def _ask(self, make: Callable[[int], tuple]) -> Any:
        assert self._proc is not None, "start() first"
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            cid = next(self._ids)
            self._calls[cid] = fut
        try:
            self._post(make(cid))
        except BaseException:
            with self._lock:
                self._calls.pop(cid, None)
            raise
        return await fut

    def _post(self, message: tuple) -> None:
        self._outbox.put(_dumps(message))

    def _send_loop(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._to_child.send_bytes(data)
            except OSError:  # the child is gone: the reader sees its pipe close and fails what waits
                return

    def _read_loop(self) -> None:
        proc = self._proc  # a close that leaves a stuck child behind drops the handle's reference
        while True:
            try:
                message = pickle.loads(self._from_child.recv_bytes())
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "results":
                _, settled, (busy_us, steps), loads, clock = message
                with self._lock:
                    self._busy = (self._busy[0] + busy_us, self._busy[1] + steps)
                    self._life = (self._life[0] + busy_us, self._life[1] + sum(charged_us(res) for _, res in settled))
                    self._loads.extend(loads)
                    self._clock = clock
                for seq, res in settled:
                    with self._lock:
                        entry = self._requests.pop(seq, None)
                        if entry is None:
                            self._unbilled_us += charged_us(res)
                    if entry is not None:
                        self._settle_result(entry[1], res)
            elif kind == "reply":
                _, cid, ok, value = message
                with self._lock:
                    fut = self._calls.pop(cid, None)
                if fut is not None:
                    _settle_soon(fut, value, ok=ok)
            elif kind == "resident":
                self._resident = message[1]
        reap(proc, timeout=5)  # and a killed child's L2 arena, which it could not unlink itself
        code = proc.exitcode
        if self._stopping:
            error = EngineError("the engine is closed", code="aborted")
        else:
            log.error("the engine process %d exited (code %s); failing what waits for it", proc.pid, code)
            error = EngineError(f"the engine process exited (code {code}) while running this request; it was logged",
                                code="engine_failed", retriable=True)  # fmt: skip
        with self._lock:
            self._dead = error
            requests, self._requests = self._requests, {}
            calls, self._calls = self._calls, {}
            if not self._stopping:  # the time its unanswered requests took in the steps received: billed to nobody
                self._unbilled_us += max(0, self._life[0] - self._life[1])
        for (tenant_id, request_id), fut in requests.values():
            _settle_soon(fut, GenerationResult(request_id=request_id, adapter_key=None, tenant_id=tenant_id, error=error))
        for fut in calls.values():
            _settle_soon(fut, error, ok=False)

    def _settle_result(self, fut: asyncio.Future, res: GenerationResult) -> None:
        """Hand a request's result to its caller; one whose caller has gone (its generate was cancelled meanwhile, its
        loop closed) is counted unbilled."""

        def dropped() -> None:
            with self._lock:
                self._unbilled_us += charged_us(res)

        _settle_soon(fut, res, dropped=dropped)


def _abandoned(proc) -> None:
    """A start that a close gave up on: kill the child it made and raise (nobody awaits it)."""
    proc.kill()
    proc.join()
    raise EngineError("the engine process's start was abandoned: the engine was closed meanwhile", code="aborted")


def _retrieve(fut: asyncio.Future) -> None:
    """Take an abandoned start's outcome, so that its error is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _left(loop: asyncio.AbstractEventLoop, until: float | None) -> float | None:
    return None if until is None else max(0.0, until - loop.time())


def _settle_soon(fut: asyncio.Future, value: Any, *, ok: bool = True, dropped: Callable[[], None] | None = None) -> None:
    """Set `fut`'s result (or exception) on its own loop; `dropped` runs instead when nobody awaits it any more."""

    def settle() -> None:
        if fut.done():  # cancelled meanwhile
            if dropped is not None:
                dropped()
        elif ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    try:
        fut.get_loop().call_soon_threadsafe(settle)
    except RuntimeError:  # its loop is closed: nobody awaits it any more
        if dropped is not None:
            dropped()


def _dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _stats(engine) -> dict:
    return engine.stats()


# ---- the child


def _child_main(config: EngineConfig, commands, results, initializer: Callable[[], None] | None) -> None:
    # ^C at a terminal reaches the whole process group: the parent decides when its engine stops (it drains first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.setswitchinterval(GIL_SWITCH_S)  # the step loop first (module docstring)
    if initializer is not None:
        initializer()
    from engine.engine import Engine  # here, not at the top: the parent of a process engine never imports torch for it

    try:
        engine = Engine(config)
    except BaseException as e:  # the parent raises it, and its caller says it once (the CLI: one line, no traceback)
        results.send_bytes(_dumps(("failed", _portable(e))))
        _exit(0)
    _freeze_gc()
    if engine.collector is not None and engine.runner.graphs is not None:  # rounds call the window: full passes wait
        hold_full_passes()
    results.send_bytes(_dumps(("ready", (engine.config, datetime.now(UTC)))))
    host = _ChildHost(engine, commands, results)
    try:
        host.run()
    finally:
        engine.adapters.close()  # the reader processes, if any
        release_segments()  # the L2 arena's /dev/shm segment: _exit skips the finalizers that would unlink it
    _exit(0)


def _exit(code: int) -> None:
    """End the child without the interpreter's teardown: what it would free there (the frozen objects, native ones
    among them) the process's end frees anyway, and nanobind would print a "leaked" line for each native type."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _freeze_gc() -> None:
    """Move every object alive now out of the cyclic collector's reach (gc.freeze), as after start-up work.

    The model, its graphs and the engine's tables are ~300,000 tracked objects at llama-1b, which every full collection
    walked again while the step loop made garbage. On the H200 (a probe of session 11, one run each, the frozen run
    last and so also the warmest) the same 274 steps of 1,024 jobs took 9.85 ms each after a freeze against
    11.97-14.11 ms before in a child, and 10.44 against 11.19 in one process. The child freezes after building its
    engine and after each new decode graph (a bounded number); objects made later are collected as usual."""
    gc.collect()
    freeze()  # gc.freeze, told to the collector's windows (engine.collector, "Freezes")


class _ChildHost(StepLoop):
    """StepLoop's host in the child: commands from the parent's pipe, results back in one message a pass."""

    def __init__(self, engine, commands, results):
        super().__init__(engine)
        self._in, self._out = commands, results
        self._settled: list[tuple[int, GenerationResult]] = []
        self._gone = False  # the parent closed its end: nobody is left to answer
        self._graphs_at = 0  # graphs captured (decode and prompt steps') when the collector last froze what lives

    def _next_command(self, block_s: float) -> Callable[[], Any] | None:
        if self._gone:
            return None
        try:
            if not self._in.poll(block_s):
                return None
            message = pickle.loads(self._in.recv_bytes())
        except (EOFError, OSError):
            self._parent_gone()
            return None
        return lambda: self._handle(message)

    def _stop_now(self) -> bool:
        return self._gone

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            self._add(message[2], message[1])
        elif kind == "abort":
            _, cid, key, only = message
            res = self._abort(key, only)
            if cid:
                self._reply(cid, True, res)
        elif kind == "call":
            _, cid, fn = message
            try:
                value = fn(self.engine)
            except Exception as e:  # handed to the caller as it is; nothing is swallowed
                self._reply(cid, False, e)
            else:
                self._reply(cid, True, value)
        elif kind == "fail_all":
            self._fail_all(RequestError("the engine is closing", code="aborted"))
            self._end_of_turn()  # the aborted results go before the reply that says they are done
            self._reply(message[1], True, None)
        elif kind == "stop":
            self._request_stop()
        else:
            raise AssertionError(f"unknown command {kind!r}")

    def _settle(self, token: int, res: GenerationResult) -> None:
        self._settled.append((token, res))

    def _publish_resident(self, keys: frozenset[str]) -> None:
        self._send(("resident", keys))

    def _end_of_turn(self) -> None:
        # The steps booked, not the round in flight: reading it back here would idle the GPU each pass (it carries on
        # while this pass sends and reads); its steps come with the pass that books them, with their results.
        steps, loads = self.engine.pop_step_records(drain=False), self.engine.pop_load_events()
        if self._settled or steps or loads:
            settled, self._settled = self._settled, []
            busy = (sum(r.total_us for r in steps), len(steps))
            self._send(("results", settled, busy, loads, datetime.now(UTC)))  # the clock after the steps popped
        graphs = sum(len(getattr(self.engine.runner, kind, None) or ()) for kind in ("graphs", "mixed"))
        if graphs != self._graphs_at:  # a capture made long-lived objects: out of the collector's way too
            self._graphs_at = graphs
            _freeze_gc()

    def _reply(self, cid: int, ok: bool, value: Any) -> None:
        try:
            data = _dumps(("reply", cid, ok, value if ok else _portable(value)))
        except Exception as e:  # the value does not pickle: say so rather than leave the caller waiting
            data = _dumps(("reply", cid, False, TypeError(f"the engine's answer ({type(value).__name__}) does not pickle: {e}")))
        self._send_bytes(data)

    def _send(self, message: tuple) -> None:
        self._send_bytes(_dumps(message))

    def _send_bytes(self, data: bytes) -> None:
        if self._gone:
            return
        try:
            self._out.send_bytes(data)
        except OSError:
            self._parent_gone()

    def _parent_gone(self) -> None:
        if self._gone:
            return
        log.warning("the engine's parent process is gone; aborting %d requests and exiting", len(self._pending))
        self._gone = True
        self._stop = True
        self._pending.clear()  # nobody awaits them now
        self.engine.abort_all(RequestError("the worker is gone", code="aborted"))


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else an EngineError that names it."""
    try:
        pickle.loads(_dumps((e,)))
        return e
    except Exception:
        return EngineError(f"{type(e).__name__}: {e}", code="engine_error")
