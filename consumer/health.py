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
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("lorabatch.worker")

LOOP_STALL_S = 15.0  # the event loop not turning this long: not live
BEAT_S = 1.0  # how often the loop says it turns
# Each connection is a thread: without a bound, 400 idle connections (a slowloris, a scraper that never closes) held
# 400 threads for good and slowed accepting to one a second for everyone, probes included. A scrape or probe needs a
# few milliseconds of one connection; Prometheus and an orchestrator hold a handful at once.
HTTP_MAX_CONNECTIONS = 32  # served at once; one more is answered 503 and closed at once
HTTP_DEADLINE_S = 10.0  # a connection still open this long (its request read and its answer written) is closed
ALLOWED = ("GET", "HEAD")


class Health:
    """What the probes read: the loop's last beat, the worker's phase, and the engine's liveness; the rest comes from
    the worker's gauges in `registry`. Written by the worker's loop, read by the server's threads."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._phase = "starting"  # starting -> connecting -> serving -> stopping -> stopped
        self.engine_alive: Callable[[], bool] = lambda: True
        self.store_root: Path | None = None  # the adapter store's folder (store.adapter_dir), once the worker has one
        self.route_cache: object | None = None  # the worker's route cache: one with a `problem` (Redis) is named when it fails
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
        redis = getattr(self.route_cache, "problem", None)  # Redis gone while serving: waiting{on="redis"} is start's alone
        degraded = [what for what, bad in (("redis", waiting["redis"] or redis is not None), ("ledger", not ledger_up),
                                           ("spool", not spool_up)) if bad]
        store = self._store_problem()
        if store is not None:
            degraded.append("adapter_store")
        body = {"ready": not why, "phase": self.phase, "engine": engine, "degraded": degraded}
        if redis is not None:
            body["redis"] = f"the route cache (Redis) fails, routing goes on by the tenants' rules and defaults: {redis}"
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
    """A thread per connection, at most `max_connections` at once (the next is answered 503 and closed without a
    thread), each closed `deadline_s` after it was accepted whatever it does (a slowloris that sends a byte a second
    keeps no thread); `dropped(why)` counts each, `why` "busy" or "deadline"."""

    daemon_threads = True
    request_queue_size = 128  # the listen backlog (socketserver's 5 dropped SYNs under a burst of connections)

    def __init__(self, address: tuple[str, int], max_connections: int, deadline_s: float,
                 dropped: Callable[[str], None]) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _QuietHandler)
        self.deadline_s = deadline_s
        self.dropped = dropped
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: dict[socket.socket, float] = {}  # connection -> its deadline (time.monotonic)
        self._open_lock = threading.Lock()

    def process_request(self, request, client_address) -> None:
        if not self._slots.acquire(blocking=False):
            self.dropped("busy")
            try:
                request.setblocking(False)  # a fresh socket's buffer takes these bytes; never wait on this client
                request.send(_BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self._open_lock:
            self._open[request] = time.monotonic() + self.deadline_s
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again (the caller closes the socket)
            self._forget(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request) -> None:
        with self._open_lock:
            if self._open.pop(request, None) is not None:
                self._slots.release()

    def service_actions(self) -> None:
        """Called by serve_forever every poll (0.5 s): connections past their deadline are shut, which ends their
        thread's read or write at once."""
        now = time.monotonic()
        with self._open_lock:
            late = [r for r, deadline in self._open.items() if deadline <= now]
            for r in late:
                self._open[r] = float("inf")  # shut once, counted once
        for r in late:
            self.dropped("deadline")
            try:
                r.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


_BUSY_TEXT = b"too many connections to this worker's metrics port at once\n"
_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
         b"Content-Length: %d\r\n\r\n%s" % (len(_BUSY_TEXT), _BUSY_TEXT))


class _QuietHandler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = 2 * self.server.deadline_s  # a backstop: the server's poll shuts the connection at its deadline
        super().setup()

    def handle(self) -> None:
        try:
            super().handle()
        except OSError:  # the client went, or its deadline came (a timeout, or the socket shut): no traceback on stderr
            pass

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (a probe every few seconds is no log line)
        pass


def make_app(registry: CollectorRegistry, health: Health):
    """/metrics from `registry`; /healthz and /readyz from `health`; 404 for the rest. Each answers GET and HEAD (the
    same status and headers, no body); any other method is 405: a POST to /healthz answered 200 as to a GET, and a
    HEAD to /metrics 405, where /healthz took it."""
    metrics = make_wsgi_app(registry)

    def app(environ, start_response):
        body = route(environ, start_response)
        if environ.get("REQUEST_METHOD") == "HEAD":
            return []  # Content-Length stays that of the GET's body
        return body

    def route(environ, start_response):
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path in ("/", "/metrics", "/healthz", "/readyz") and method not in ALLOWED:
            data = f"method {method[:20]} not allowed: {path} answers GET and HEAD\n".encode("ascii", "replace")
            start_response("405 Method Not Allowed", [("Allow", ", ".join(ALLOWED)), ("Content-Type", "text/plain"),
                                                      ("Content-Length", str(len(data)))])
            return [data]
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
            return metrics({**environ, "REQUEST_METHOD": "GET"}, start_response)  # prometheus_client answers HEAD 405
        data = b"not found: this worker serves /metrics, /healthz and /readyz\n"
        start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", str(len(data)))])
        return [data]

    return app


def serve(port: int, registry: CollectorRegistry, health: Health, addr: str = "0.0.0.0",
          dropped: Callable[[str], None] = lambda why: None) -> WSGIServer:
    """Serve /metrics, /healthz and /readyz on `port` from a daemon thread; OSError if the port cannot be had.
    `dropped(why)`: a connection closed unanswered, `why` "busy" (HTTP_MAX_CONNECTIONS open) or "deadline"."""
    server = _Server((addr, port), HTTP_MAX_CONNECTIONS, HTTP_DEADLINE_S, dropped)
    server.set_app(make_app(registry, health))
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
