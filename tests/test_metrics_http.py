"""The worker's metrics port as a hostile client and an SRE's tools meet it (consumer.health): methods other than GET
and HEAD are refused on every path, and idle or trickling connections neither pile up threads nor stay open."""

from __future__ import annotations

import http.client
import socket
import time

import pytest

import consumer.health as health_mod
from consumer.broker import free_port
from consumer.metrics import WorkerMetrics


@pytest.fixture
def served(monkeypatch):
    monkeypatch.setattr(health_mod, "HTTP_MAX_CONNECTIONS", 4)
    monkeypatch.setattr(health_mod, "HTTP_DEADLINE_S", 1.0)
    m = WorkerMetrics()
    port = free_port()
    m.serve(port)
    yield m, port
    m.server.shutdown()
    m.server.server_close()


def ask(port: int, method: str, path: str) -> tuple[int, dict, bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, body=b"x" if method in ("POST", "PUT") else None)
        r = c.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        c.close()


@pytest.mark.parametrize("path, status", [("/metrics", 200), ("/", 200), ("/healthz", 200), ("/readyz", 503)])
def test_each_path_answers_get_and_head_alike_and_refuses_other_methods(served, path, status):
    """HEAD is a GET without its body on every path (it was 405 on /metrics and 200 on /healthz); POST, PUT, DELETE,
    PATCH and made-up methods are 405 with `Allow: GET, HEAD` on every path (they were 200 on /healthz and /readyz,
    as if a read)."""
    _, port = served
    got, headers, body = ask(port, "GET", path)
    assert got == status and body
    got, head_headers, head_body = ask(port, "HEAD", path)
    assert got == status and head_body == b""
    assert head_headers["Content-Type"] == headers["Content-Type"]
    for method in ("POST", "PUT", "DELETE", "PATCH", "BREW"):
        got, headers, body = ask(port, method, path)
        assert got == 405, (method, path, got)
        assert headers["Allow"] == "GET, HEAD" and b"GET and HEAD" in body
    assert ask(port, "POST", "/admin")[0] == 404


def _closed_by_server(s: socket.socket) -> bytes:
    """What the server sent before it closed `s` (waits for the close; fails if it never comes)."""
    s.settimeout(10)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    return data


def _dropped(m: WorkerMetrics, why: str) -> float:
    return m.registry.get_sample_value("lorabatch_http_connections_dropped_total", {"why": why}) or 0


def test_idle_connections_are_bounded_closed_and_counted(served):
    """Ten connections that send half a request line and wait: four (HTTP_MAX_CONNECTIONS) are held, the other six are
    answered 503 at once and closed; the four are closed at HTTP_DEADLINE_S, and the port answers again. Before, each
    idle connection held a thread for good (400 of them slowed accepting to one a second)."""
    m, port = served
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    for s in idle:
        s.sendall(b"GET /metrics HT")
    extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    for s in extra:
        assert _closed_by_server(s).startswith(b"HTTP/1.0 503 ")
    assert _dropped(m, "busy") == 6
    for s in idle:
        assert _closed_by_server(s) == b""  # closed unanswered at its deadline
        s.close()
    assert _dropped(m, "deadline") == 4
    # the client sees its connection shut before the server's thread gives the slot back: the port answers again soon
    for _ in range(50):
        if (status := ask(port, "GET", "/healthz")[0]) == 200:
            break
        time.sleep(0.05)
    assert status == 200


def test_a_trickling_client_is_closed_at_its_deadline(served):
    """A slowloris sending a byte every 0.1 s resets any per-read timeout; the deadline counts from the accept, so its
    connection is closed all the same."""
    m, port = served
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(0.1)
    line = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * 1000
    closed = False
    for byte in line:
        try:
            s.sendall(bytes([byte]))
            if s.recv(1) == b"":
                closed = True
                break
        except socket.timeout:
            continue
        except OSError:
            closed = True
            break
    s.close()
    assert closed and _dropped(m, "deadline") == 1


@pytest.mark.parametrize("host, family", [("127.0.0.1", socket.AF_INET), ("::1", socket.AF_INET6)])
def test_the_metrics_host_is_the_address_listened_on(host, family):
    """worker.metrics_host picks the address (every IPv4 interface, 0.0.0.0, was the only choice: no way to keep the
    port to this host, nor to serve an IPv6 network); the port is answered there."""
    from consumer.config import load_settings

    s = load_settings(None, {"worker.metrics_host": host})
    m = WorkerMetrics()
    port = free_port()
    m.serve(port, s.worker.metrics_host)
    try:
        assert m.server.socket.family == family and m.server.server_address[0] == host
        c = http.client.HTTPConnection(host, port, timeout=10)
        c.request("GET", "/healthz")
        assert c.getresponse().status == 200
        c.close()
    finally:
        m.server.shutdown()
        m.server.server_close()


@pytest.mark.parametrize("bad", ["localhost", "0.0.0.0:9100", "", "256.1.1.1"])
def test_a_metrics_host_that_is_no_address_is_refused_naming_the_key(bad):
    from consumer.config import ConfigError, load_settings

    with pytest.raises(ConfigError, match=r"worker.metrics_host.*is not an IP address"):
        load_settings(None, {"worker.metrics_host": bad})


def test_an_address_taken_names_the_port_the_host_and_the_keys():
    from consumer.config import ConfigError

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port {port} of 0.0.0.0 \(Address already in use\).*worker.metrics_port "
                                              rf"\(or --metrics-port\).*worker.metrics_host"):
            WorkerMetrics().serve(port)
