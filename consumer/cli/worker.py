"""`lorabatch worker`: one worker process (one per GPU); SIGTERM drains and exits.

Started before its ledger, broker or Redis, the worker waits for each (one log line per attempt, backoff
capped at worker.wait_max_s) instead of exiting; SIGTERM during a wait ends it cleanly.

A `--worker-id` that another live worker holds ends the start (exit status 2) before the engine is built: a refused
GPU worker loaded its model (minutes) for nothing. The id is held, and its lease refreshed, from then to the exit.
"""

from __future__ import annotations

import functools
import threading
from typing import Annotated, Optional

import typer

from consumer.cli.common import ConfigOpt, fail, settings_from, setup_logging


def worker(config: ConfigOpt = None, log_level: str = "INFO",
           worker_id: Annotated[Optional[str], typer.Option(help="stable id: the static group member name, ledger worker and spool file; 1-64 letters, digits, '.', '_', '-'")] = None,
           metrics_port: Annotated[Optional[int], typer.Option(help="serve Prometheus /metrics on this port")] = None) -> None:
    """Consume jobs, run them on the engine, publish results, bill them, commit. SIGTERM drains and exits."""
    import asyncio
    import logging
    import signal

    from consumer.config import WORKER_ID_RULE, worker_id_ok
    from consumer.metrics import WorkerMetrics
    from consumer.spool import SpoolNoSpace
    from consumer.waits import Stopped, wait_for, wait_for_ledger
    from consumer.worker import Worker
    from consumer.worker_lease import lease_for
    from engine.engine_process import EngineProcess

    if worker_id is not None and not worker_id_ok(worker_id):  # named as the option, before the config's check names the key
        shown = repr(worker_id) if len(worker_id) <= 80 else f"{worker_id[:80]!r}... ({len(worker_id)} characters)"
        fail(f"--worker-id {shown} is not a worker id: write {WORKER_ID_RULE} (it names the spool file and the "
             f"Kafka group member; worker.worker_id in the config takes the same)")
    setup_logging(log_level)
    log = logging.getLogger("lorabatch.worker")
    s = settings_from(config, **{"worker.worker_id": worker_id, "worker.metrics_port": metrics_port})
    # /metrics first: a port another process holds stops the worker now, not after its engine is built (minutes of model
    # loading on a GPU) and its ledger found; and a worker waiting for its ledger says so there.
    metrics = WorkerMetrics()
    if s.worker.metrics_port:
        metrics.serve(s.worker.metrics_port, s.worker.metrics_host)
    # A SIGTERM or ^C before the event loop's handlers take over is kept here, not left to Python's defaults: one during
    # the engine's start killed the worker at once, without a log line, and left its child building an engine (a model
    # on a GPU: minutes) that then died with a traceback on the closed pipe.
    stop_requested = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop_requested.set())
    engine = None

    async def main() -> None:
        nonlocal engine
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()
        running: list[Worker] = []

        def stop() -> None:
            metrics.health.phase = "stopping"
            stopping.set()
            stop_requested.set()  # an engine process being built is killed
            for w in running:
                w.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        metrics.health.phase = "connecting"
        beat = asyncio.create_task(metrics.health.beat_forever(), name="health-beat")  # /healthz: the loop turns
        svc = None
        # The id first (WorkerIdTaken: exit status 2), refreshed on this loop while a thread builds the engine.
        lease = lease_for(s, conflicts=metrics.worker_id_conflicts)
        try:  # every way out says `stopped` on /readyz: a stop or failure in the ledger's wait left `stopping`/`connecting`
            if stop_requested.is_set():  # asked before the loop's handlers took over
                stop()
            if lease is not None:
                await lease.acquire(stopping)
                if stopping.is_set():
                    log.info("stopped while waiting for worker id %s; nothing was fetched", lease.worker_id)
                    return
                lease.start_refreshing()
            engine = await asyncio.to_thread(build_engine, s, stop_requested, log_level)
            if engine is None:
                log.info("stopped while the engine process was building its engine; nothing was fetched")
                return
            if stop_requested.is_set():  # asked while the engine was built (on a thread, not stoppable)
                stop()
            metrics.ledger_up.set(0)  # not known to take writes until it answers
            metrics.waiting.labels("ledger").set(1)
            try:
                svc = await wait_for_ledger(s, stopping)
            except Stopped:
                log.info("stopped while waiting for the ledger; nothing was fetched")
                return
            metrics.ledger_up.set(1)
            metrics.waiting.labels("ledger").set(0)

            async def make_worker() -> Worker:
                return Worker(s, engine, svc.registry, svc.ledger, metrics=metrics, lease=lease)

            try:  # a spool whose disk is full is waited for, as the ledger is: exiting made a crash loop of it
                w = await wait_for("space for the worker's spool", make_worker, stopping=stopping, retry=(SpoolNoSpace,),
                                   max_s=s.worker.wait_max_s, hint="free space on its disk, or set worker.spool_path "
                                   "to a file on another")  # fmt: skip
            except Stopped:
                log.info("stopped while waiting for space for the spool; nothing was fetched")
                return
            running.append(w)
            if stopping.is_set():
                w.stop()
            log.info("worker %s starting on %s", w.worker_id, s.kafka.bootstrap_servers)
            await w.run()
        finally:
            metrics.health.phase = "stopped"
            beat.cancel()
            if lease is not None:  # the worker gave it back when it ran; not when the start ended before it did
                await lease.release()
            if svc is not None:
                svc.close()

    try:
        asyncio.run(main())
    finally:
        if isinstance(engine, EngineProcess):  # the worker closes it when it ran; not when it stopped while waiting
            asyncio.run(engine.close(drain=False))


def build_engine(s, stop_requested: threading.Event, log_level: str):
    """The worker's engine, built as configured (minutes for a model on a GPU); None when a stop request ended an engine
    process's build."""
    from engine.api import EngineError
    from engine.engine import Engine
    from engine.engine_process import EngineProcess

    if not s.worker.engine_process:
        return Engine(s.engine)
    engine = EngineProcess(s.engine, initializer=functools.partial(_child_setup, log_level))  # the step loop in a child:
    try:  # no Python of this process delays its launches
        engine.start(stop_requested)  # blocks while the child builds its engine; a stop request kills the child
    except EngineError:
        if not stop_requested.is_set():
            raise
        return None
    return engine


def _child_setup(log_level: str) -> None:
    """The engine child's first act: the worker's log format, and SIGTERM left to the worker, which drains and then
    closes the engine (the child ignores ^C on its own; it exits when the worker closes its pipe)."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    setup_logging(log_level)


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
