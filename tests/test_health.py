"""/healthz and /readyz beside /metrics: what an orchestrator's probes read of a worker (consumer.health)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

import consumer.health as health_mod
from consumer.broker import free_port
from consumer.metrics import WorkerMetrics


def get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture
def served():
    m = WorkerMetrics()
    port = free_port()
    m.serve(port)
    yield m, port
    m.server.shutdown()
    m.server.server_close()


def test_each_path_answers_and_the_rest_is_404(served):
    m, port = served
    m.requests.labels("acme", "support", "ok").inc()
    status, body = get(port, "/metrics")
    assert status == 200 and b'lora_request_total{adapter="support",status="ok",tenant="acme"} 1.0' in body
    status, body = get(port, "/healthz")
    assert status == 200 and json.loads(body) == {"live": True, "phase": "starting", "loop": "not started"}
    status, body = get(port, "/readyz")
    assert status == 503 and json.loads(body)["reasons"] == ["the engine is being built"]
    status, body = get(port, "/admin")
    assert status == 404 and b"/metrics, /healthz and /readyz" in body


def test_ready_only_while_serving_with_an_engine_and_somewhere_to_bill():
    m = WorkerMetrics()
    h = m.health
    h.phase = "serving"
    assert h.ready() == (True, {"ready": True, "phase": "serving", "engine": True, "degraded": []})
    m.waiting.labels("redis").set(1)  # it routes without its cache: still serving
    m.ledger_up.set(0)  # the spool takes the records
    ok, body = h.ready()
    assert ok and body["degraded"] == ["redis", "ledger"], body
    m.spool_up.set(0)  # nowhere to bill what it runs
    ok, body = h.ready()
    assert not ok and body["reasons"] == ["neither the ledger nor the local spool takes records"], body
    m.ledger_up.set(1)
    m.spool_up.set(1)
    h.engine_alive = lambda: False
    ok, body = h.ready()
    assert not ok and body["engine"] is False and "its engine is not running" in body["reasons"][0], body
    h.engine_alive = lambda: True
    m.waiting.labels("broker").set(1)
    assert h.ready()[1]["reasons"] == ["it waits for its broker"]
    m.waiting.labels("broker").set(0)
    m.ledger_schema_ok.set(0)
    assert "lorabatch db upgrade" in h.ready()[1]["reasons"][0]
    m.ledger_schema_ok.set(1)
    for phase, says in (("connecting", "connecting to its ledger"), ("stopping", "stopping"), ("stopped", "stopped")):
        h.phase = phase
        ok, body = h.ready()
        assert not ok and says in body["reasons"][0], body


async def test_a_blocked_event_loop_fails_the_liveness_probe(served, monkeypatch):
    """The server's threads answer while the worker's loop is blocked (a call that never returns on it): /healthz turns
    503 once the loop has not turned for LOOP_STALL_S, and 200 again once it turns."""
    m, port = served
    monkeypatch.setattr(health_mod, "LOOP_STALL_S", 0.5)
    monkeypatch.setattr(health_mod, "BEAT_S", 0.05)
    beat = asyncio.create_task(m.health.beat_forever())
    try:
        await asyncio.sleep(0.1)
        status, body = await asyncio.to_thread(get, port, "/healthz")
        assert status == 200 and json.loads(body)["live"], body
        got = {}
        probe = threading.Thread(target=lambda: got.update(answer=get(port, "/healthz")))
        time.sleep(0.7)  # the loop blocked, and still blocked while the probe asks
        probe.start()
        probe.join(5)
        status, body = got["answer"]
        assert status == 503, body
        assert "has not turned for" in json.loads(body)["reason"], body
        await asyncio.sleep(0.2)
        status, _ = await asyncio.to_thread(get, port, "/healthz")
        assert status == 200
    finally:
        beat.cancel()


@pytest.mark.parametrize("fault, says", [
    ("moved", "is missing"),  # an operator's `mv store store.bak`
    ("file", "is not a folder"),  # replaced by a file of the same name
])
def test_readyz_names_an_adapter_store_gone_from_under_the_worker(tmp_path, fault, says):
    """The store gone leaves the worker ready (base-model jobs still run; each adapter job fails adapter_missing), but
    /readyz says so under `degraded`, with the folder and how to fix it, where it answered all well."""
    m = WorkerMetrics()
    h = m.health
    h.phase = "serving"
    root = tmp_path / "store"
    root.mkdir()
    h.store_root = root
    assert h.ready() == (True, {"ready": True, "phase": "serving", "engine": True, "degraded": []})
    root.rename(tmp_path / "store.bak")
    if fault == "file":
        root.write_bytes(b"not a store")
    ok, body = h.ready()
    assert ok and body["degraded"] == ["adapter_store"], body
    assert f"the adapter store {root} {says}" in body["adapter_store"] and "store.adapter_dir" in body["adapter_store"], body
    if fault == "moved":
        (tmp_path / "store.bak").rename(root)  # put back: all well again
        assert h.ready() == (True, {"ready": True, "phase": "serving", "engine": True, "degraded": []})


def test_a_probe_that_raises_answers_500_with_a_json_body(served, caplog):
    """A check that raises inside the probe's thread (an engine handle let go of mid-read) answered wsgiref's
    text/plain 'A server error occurred.  Please contact the administrator.' with its traceback on bare stderr; it is a
    500 whose JSON body names the error, as every other probe answer is JSON, and the traceback goes to the log."""
    m, port = served
    m.health.phase = "serving"

    def boom() -> bool:
        raise AttributeError("'NoneType' object has no attribute 'is_alive'")

    m.health.engine_alive = boom
    status, body = get(port, "/readyz")
    assert status == 500, (status, body)
    answer = json.loads(body)
    assert answer["ready"] is False and "AttributeError" in answer["error"] and "is_alive" in answer["error"], answer
    assert any("/readyz" in r.getMessage() for r in caplog.records), caplog.records
    status, body = get(port, "/healthz")  # the other probe is untouched
    assert status == 200 and json.loads(body)["live"] is True


def test_a_stopped_worker_stays_stopped():
    """A SIGTERM in the moment after the worker's loop ended set the phase back to "stopping"."""
    h = WorkerMetrics().health
    for phase in ("connecting", "serving", "stopping", "stopped"):
        h.phase = phase
        assert h.phase == phase
    h.phase = "stopping"
    assert h.phase == "stopped" and h.ready()[1]["reasons"] == ["the worker has stopped"]
