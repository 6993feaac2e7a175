"""What the benches watch a pass with, beside its own figures: the stacks of slow engine.step() calls, where their host
time goes phase by phase, the garbage collector's pauses, and Triton's compiles (engine.bench.adapters, engine.bench.batch_sweep, consumer.bench.pipeline)."""

from __future__ import annotations

import gc
import itertools
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path


class StallStacks:
    """Where an engine.step() call that runs past `after_ms` spends its time: a thread samples the calling thread's stack
    every 5 ms of such a call (its innermost frames); `top` gives the most frequent stacks with their sample counts."""

    def __init__(self, after_ms: float = 20.0, depth: int = 8):
        self._after, self._depth = after_ms / 1e3, depth
        self._ident, self._start = threading.get_ident(), None
        self.samples: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-stacks", daemon=True)
        self._thread.start()

    def begin(self) -> float:
        self._start = time.perf_counter()
        return self._start

    def end(self) -> None:
        self._start = None

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            start = self._start
            if start is None or time.perf_counter() - start < self._after:
                continue
            frame = sys._current_frames().get(self._ident)
            if frame is not None:  # the innermost frames only: a whole extract_stack held the GIL ~0.25 ms a sample
                stack = itertools.islice(traceback.walk_stack(frame), self._depth)
                self.samples[" <- ".join(f"{Path(f.f_code.co_filename).name}:{line} {f.f_code.co_name}" for f, line in stack)] += 1

    def top(self, n: int = 3) -> list[dict]:
        """The n most sampled stacks; "ms" counts 5 ms a sample, a floor (a sample comes 5 ms or more after the last)."""
        return [{"samples": c, "ms": 5 * c, "stack": s} for s, c in self.samples.most_common(n)]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class GcPauses:
    """Milliseconds the garbage collector ran since `ms` was last set (gc.callbacks), until `close`; `longest` the
    longest pass since it was last set, as (ms, generation)."""

    def __init__(self):
        self.ms, self._t0 = 0.0, 0.0
        self.longest: tuple[float, int] | None = None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            ms = (time.perf_counter() - self._t0) * 1e3
            self.ms += ms
            if self.longest is None or ms > self.longest[0]:
                self.longest = (round(ms, 2), info.get("generation", -1))

    def close(self) -> None:
        gc.callbacks.remove(self._tick)


class Compiles:
    """Counts Triton JIT compiles (kernel variants first met in this process) while entered, through Triton's
    post-compile hook; counts nothing where this Triton has no such hook (`take` then gives None)."""

    def __init__(self):
        try:
            from triton import knobs

            self._runtime = knobs.runtime
        except (ImportError, AttributeError):
            self._runtime = None
        self._n = 0

    def __enter__(self) -> Compiles:
        if self._runtime is not None and hasattr(self._runtime, "jit_post_compile_hook"):
            self._saved = self._runtime.jit_post_compile_hook
            self._runtime.jit_post_compile_hook = self._hook
        else:
            self._runtime = None
        return self

    def __exit__(self, *exc) -> None:
        if self._runtime is not None:
            self._runtime.jit_post_compile_hook = self._saved

    def _hook(self, *args, **kwargs) -> None:
        self._n += 1

    def take(self) -> int | None:
        """Compiles since the last take."""
        n, self._n = self._n, 0
        return n if self._runtime is not None else None


class StepPhases:
    """Where each engine.step() call's host time goes, while entered: the wall and thread-CPU time of the engine's
    phases (launching the next decode round, the load-ahead, the collector's window, booking the round read back, a
    prompt step) and the collector's own pauses (gc.callbacks) in it. The Engine class's phase methods and
    engine.engine's round functions are wrapped while entered and put back on exit. A phase whose wall time runs far
    past its CPU time waited (the GIL, a blocking call); one whose CPU time is the collector's pauses collected."""

    METHODS = ("step", "_next_round", "_under_round", "_load_ahead", "_collect", "_run", "_pop_done")
    FUNCTIONS = ("launch_round", "book_round")

    def __init__(self):
        self.calls: list[dict] = []
        self._cur: dict | None = None
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> StepPhases:
        import engine.engine as module

        for owner, names in ((module.Engine, self.METHODS), (module, self.FUNCTIONS)):
            for name in names:
                fn = getattr(owner, name)
                self._saved.append((owner, name, fn))
                setattr(owner, name, self._call(fn) if name == "step" else self._phase(name, fn))
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._gc)
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)
        self._saved.clear()

    def _call(self, fn):
        def step(engine):
            self._cur = cur = {"phases": {}, "gc_ns": 0}
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(engine)
            finally:
                cur["wall_ns"], cur["cpu_ns"] = time.perf_counter_ns() - t0, time.thread_time_ns() - c0
                self._cur = None
                self.calls.append(cur)
        return step

    def _phase(self, name: str, fn):
        def timed(*args, **kwargs):
            cur = self._cur
            t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                if cur is not None:
                    wall, cpu = cur["phases"].get(name, (0, 0))
                    cur["phases"][name] = (wall + time.perf_counter_ns() - t0, cpu + time.thread_time_ns() - c0)
        return timed

    def _gc(self, phase: str, info: dict) -> None:
        cur = self._cur
        if cur is None:
            return
        if phase == "start":
            cur["gc_t0"] = time.perf_counter_ns()
        elif "gc_t0" in cur:
            cur["gc_ns"] += time.perf_counter_ns() - cur.pop("gc_t0")

    def take(self, slowest: int = 5) -> list[dict]:
        """The `slowest` calls since the last take, longest first, in ms: wall, CPU, the collector's pauses, and each
        phase's [wall, CPU]."""
        calls, self.calls = self.calls, []
        ms = lambda ns: round(ns / 1e6, 2)  # noqa: E731
        return [{"wall_ms": ms(c["wall_ns"]), "cpu_ms": ms(c["cpu_ns"]), "gc_ms": ms(c["gc_ns"]),
                 "phases": {n: [ms(w), ms(p)] for n, (w, p) in sorted(c["phases"].items(), key=lambda x: -x[1][0])}}
                for c in sorted(calls, key=lambda c: -c["wall_ns"])[:slowest]]  # fmt: skip
