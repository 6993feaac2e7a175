"""`lorabatch worker --metrics-port P` at start: /metrics is served before the engine is built and the ledger found, so a
port another process holds stops the worker at once, and a worker waiting for its ledger says so on /metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from consumer.broker import free_port
from consumer.config import load_settings
from tests.service_fixtures import open_services, running_worker


def _worker(tmp_path: Path, demo_set, metrics_port: int) -> subprocess.Popen:
    """A worker whose ledger (PostgreSQL on a port where nothing listens) is down."""
    cfg = tmp_path / "lorabatch.toml"
    cfg.write_text(f'[engine]\nmodel_dir = "{demo_set["model"]}"\ndevice = "cpu"\n[worker]\nwait_max_s = 1.0\n'
                   f'[ledger]\nurl = "postgresql+psycopg://postgres@127.0.0.1:{free_port()}/nowhere"\n')
    env = {k: v for k, v in os.environ.items() if k != "LORABATCH_CONFIG"}
    return subprocess.Popen([sys.executable, "-m", "consumer.cli", "worker", "-c", str(cfg), "--metrics-port",
                             str(metrics_port)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)


def test_a_metrics_port_in_use_stops_the_worker_before_it_waits_for_anything(tmp_path, demo_set):
    """Two workers on one host with one metrics port: the second exits with status 2 and one line naming the port and
    worker.metrics_port, before its engine is built. It was said only once the engine was built and the ledger answered,
    so with the ledger down the second worker waited (for ever) without a word about the port."""
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = _worker(tmp_path, demo_set, port)
        try:
            err = worker.communicate(timeout=60)[1]
        finally:
            worker.kill()
    assert worker.returncode == 2, err
    lines = [json.loads(x) for x in err.splitlines() if x.strip()]
    assert "Traceback" not in err and lines[-1]["level"] == "ERROR", err
    assert f"port {port}" in lines[-1]["msg"] and "worker.metrics_port" in lines[-1]["msg"], lines[-1]
    assert not any("waiting for the ledger" in x["msg"] for x in lines), err


def test_metrics_say_the_worker_waits_for_its_ledger(tmp_path, demo_set):
    """While the worker waits for its ledger at start, /metrics answers with lorabatch_ledger_up 0 and
    lorabatch_waiting{on="ledger"} 1 (it was not served at all until the ledger answered: the scrape target was
    simply down); SIGTERM still ends the wait with status 0."""
    port = free_port()
    worker = _worker(tmp_path, demo_set, port)
    try:
        text = ""
        deadline = time.monotonic() + 60
        while 'lorabatch_waiting{on="ledger"} 1.0' not in text and worker.poll() is None and time.monotonic() < deadline:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        assert 'lorabatch_waiting{on="ledger"} 1.0' in text, text
        assert "\nlorabatch_ledger_up 0.0\n" in text, text
        # The probes: its loop turns (live), and it is not ready while it connects.
        live = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).read())
        assert live["live"] and live["phase"] == "connecting" and live["loop_quiet_s"] < 5, live
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5)
        ready = json.loads(not_ready.value.read())
        assert not_ready.value.code == 503 and ready["reasons"] == ["connecting to its ledger, broker and Redis"], ready
        assert ready["degraded"] == ["ledger"], ready
        worker.send_signal(signal.SIGTERM)
        err = worker.communicate(timeout=60)[1]
    finally:
        worker.kill()
    assert worker.returncode == 0, err
    assert "stopped while waiting for the ledger" in err, err


@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
async def test_metrics_say_the_worker_waits_for_its_broker(tmp_path, demo_set, cpu_engine, ledger_url):
    """Started while its broker is down, the worker logged each attempt but its /metrics looked like an idle worker's
    (lorabatch_waiting had no broker series until a publish failed); it is 1 now until the broker answers."""
    s = load_settings(None, {"kafka.bootstrap_servers": f"127.0.0.1:{free_port()}", "engine.model_dir": str(demo_set["model"]),
                             "engine.device": "cpu", "engine.max_new_tokens": 32, "engine.max_prompt_tokens": 200,
                             "worker.wait_max_s": 1.0, "worker.spool_path": str(tmp_path / "spool.sqlite"),
                             "store.adapter_dir": str(tmp_path / "store"), "ledger.url": ledger_url})
    svc = open_services(s)
    async with running_worker(s, svc, cpu_engine) as rw:
        waiting = rw.worker.metrics.waiting
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while waiting.labels("broker")._value.get() != 1 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        assert waiting.labels("broker")._value.get() == 1
        assert not rw.task.done()
    svc.close()


@pytest.mark.parametrize("ends", ["stopped", "failed"])
def test_the_phase_is_stopped_whichever_way_the_ledger_wait_ends(tmp_path, demo_set, monkeypatch, ends):
    """A worker stopped (SIGTERM) or failed while it waited for its ledger left /readyz saying `stopping` or
    `connecting` for as long as the process still ran (an engine child being closed: up to a minute), and its
    heartbeat task running; every way out of the worker's loop now says `stopped`."""
    import consumer.metrics
    import consumer.waits
    import engine.engine
    from consumer.cli.worker import worker

    made = []

    class Metrics(consumer.metrics.WorkerMetrics):
        def __init__(self) -> None:
            super().__init__()
            made.append(self)

    async def wait_for_ledger(s, stopping):
        if ends == "stopped":
            raise consumer.waits.Stopped()
        raise RuntimeError("the ledger wait failed")

    monkeypatch.setattr(consumer.metrics, "WorkerMetrics", Metrics)
    monkeypatch.setattr(consumer.waits, "wait_for_ledger", wait_for_ledger)
    monkeypatch.setattr(engine.engine, "Engine", lambda cfg: object())
    monkeypatch.delenv("LORABATCH_CONFIG", raising=False)
    cfg = tmp_path / "lorabatch.toml"
    cfg.write_text(f'[engine]\nmodel_dir = "{demo_set["model"]}"\ndevice = "cpu"\n[worker]\nengine_process = false\n')
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ends == "stopped":
            worker(config=cfg)
        else:
            with pytest.raises(RuntimeError):
                worker(config=cfg)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert made[0].health.phase == "stopped"
