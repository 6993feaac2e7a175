"""The worker's HTTP endpoints beside /metrics: /healthz (liveness) and /readyz (readiness), for an orchestrator's probes.

/healthz answers 200 while the worker's event loop turns: a loop blocked for LOOP_STALL_S (a call that never returns,
a thread holding it) answers 503, so a liveness probe restarts a worker that would otherwise sit there, connected and
silent, its heartbeats to the broker kept by aiokafka's own thread. Before the loop starts (the engine being built,
minutes of model loading on a GPU) it answers 200: starting is not hung.

/readyz answers 200 while the worker consumes: joined to its group and not waiting for its broker, its engine running,
not stopping, and able to bill what it runs (the ledger takes rows or the spool does, and the ledger's schema is
current). Otherwise 503. Both
answer a JSON body naming each check, and /readyz the dependencies it serves without (Redis, the ledger, while the
spool takes their place; the adapter store, gone or unreadable under it) under "degraded". A store gone leaves the worker
ready: jobs on the base model still run and each job for an adapter fails with the adapter's own code (adapter_missing),
but /readyz names the folder and what is wrong with it, where it said nothing (each probe stats the folder: one call).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("lorabatch.worker")

LOOP_STALL_S = 15.0  # the event loop not turning this long: not live
BEAT_S = 1.0  # how often the loop says it turns


class Health:
    """What the probes read: the loop's last beat, the worker's phase, and the engine's liveness; the rest comes from
    the worker's gauges in `registry`. Written by the worker's loop, read by the server's threads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._phase = "starting"  # starting -> connecting -> serving -> stopping -> stopped
        self.engine_alive: Callable[[], bool] = lambda: True
        self.store_root: Path | None = None  # the adapter store's folder (store.adapter_dir), once the worker has one
        self._beat_at: float | None = None

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        """Move to `phase`; never out of "stopped" (a SIGTERM in the moment after the worker's loop ended said "stopping"
        again, for a worker that had already stopped)."""
        if self._phase != "stopped":
            self._phase = phase

    def beat(self) -> None:
        self._beat_at = time.monotonic()

    async def beat_forever(self) -> None:
        """Beat every BEAT_S until cancelled: run it on the loop the worker runs on."""
        while True:
            self.beat()
            await asyncio.sleep(BEAT_S)

    def _gauge(self, name: str, **labels: str) -> float | None:
        return self.registry.get_sample_value(name, labels)

    def live(self) -> tuple[bool, dict]:
        beat = self._beat_at
        if beat is None:
            return True, {"live": True, "phase": self.phase, "loop": "not started"}
        quiet = time.monotonic() - beat
        ok = quiet < LOOP_STALL_S
        body = {"live": ok, "phase": self.phase, "loop_quiet_s": round(quiet, 3)}
        if not ok:
            body["reason"] = f"the event loop has not turned for {quiet:.0f} s (over {LOOP_STALL_S:g} s)"
        return ok, body

    def ready(self) -> tuple[bool, dict]:
        live, _ = self.live()
        waiting = {on: self._gauge("lorabatch_waiting", on=on) == 1 for on in ("broker", "redis", "ledger", "spool")}
        ledger_up = self._gauge("lorabatch_ledger_up") != 0
        spool_up = self._gauge("lorabatch_spool_up") != 0
        schema_ok = self._gauge("lorabatch_ledger_schema_ok") != 0
        engine = self.engine_alive()
        why = []
        if self.phase != "serving":
            why.append({"starting": "the engine is being built", "connecting": "connecting to its ledger, broker and Redis",
                        "stopping": "the worker is stopping", "stopped": "the worker has stopped"}[self.phase])
        else:
            if not engine:
                why.append("its engine is not running (died: a new one is being started)")
            if waiting["broker"]:
                why.append("it waits for its broker")
        if not live:
            why.append("its event loop does not turn")
        if not schema_ok:
            why.append("the ledger's schema is missing or behind: run `lorabatch db upgrade`")
        if not ledger_up and not spool_up:
            why.append("neither the ledger nor the local spool takes records")
        degraded = [what for what, bad in (("redis", waiting["redis"]), ("ledger", not ledger_up),
                                           ("spool", not spool_up)) if bad]
        store = self._store_problem()
        if store is not None:
            degraded.append("adapter_store")
        body = {"ready": not why, "phase": self.phase, "engine": engine, "degraded": degraded}
        if store is not None:
            body["adapter_store"] = store
        if why:
            body["reasons"] = why
        return not why, body

    def _store_problem(self) -> str | None:
        """What is wrong with the adapter store's folder for this worker, or None."""
        root = self.store_root
        if root is None:
            return None
        fix = "jobs for its adapters fail (adapter_missing); put it back or point store.adapter_dir at the store"
        try:
            if not os.path.isdir(root):
                what = "is not a folder" if os.path.lexists(root) else "is missing"
                return f"the adapter store {root} {what}: {fix}"
            if not os.access(root, os.R_OK | os.X_OK):
                return f"the adapter store {root} cannot be read by this worker (permissions): {fix}"
        except OSError as e:  # a stat that fails (an NFS mount gone stale): as unreadable
            return f"the adapter store {root} cannot be read ({e.strerror or e}): {fix}"
        return None


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (a probe every few seconds is no log line)
        pass


def make_app(registry: CollectorRegistry, health: Health):
    """/metrics from `registry`; /healthz and /readyz from `health`; 404 for the rest."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/readyz"):
            try:
                ok, body = health.live() if path == "/healthz" else health.ready()
                status = "200 OK" if ok else "503 Service Unavailable"
            except Exception as e:  # noqa: BLE001  (a check's bug is a 500 that says so, not wsgiref's text/plain page)
                log.exception("the %s probe failed", path)
                status, body = "500 Internal Server Error", {"live" if path == "/healthz" else "ready": False,
                                                             "error": f"{type(e).__name__}: {e}"}
            data = json.dumps(body).encode()
            start_response(status,
                           [("Content-Type", "application/json"), ("Content-Length", str(len(data)))])
            return [data]
        if path in ("/", "/metrics"):
            return metrics(environ, start_response)
        data = b"not found: this worker serves /metrics, /healthz and /readyz\n"
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
        return [data]

    return app


def serve(port: int, registry: CollectorRegistry, health: Health, addr: str = "0.0.0.0") -> WSGIServer:
    """Serve /metrics, /healthz and /readyz on `port` from a daemon thread; OSError if the port cannot be had."""
    server = make_server(addr, port, make_app(registry, health), _Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
