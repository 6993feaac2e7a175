"""A hostile producer cannot grow the worker's Prometheus series or forge its log: thousands of distinct tenant ids,
adapter references, user and session ids, unknown fields and broken messages, through the worker's real intake
(parse, a real registry on SQLite, the router, the answer count), leave every label within a closed set and every log
line one short JSON object."""

from __future__ import annotations

import ast
import asyncio
import io
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from aiokafka import TopicPartition

from billing.db import make_engine, session_factory, upgrade
from consumer.config import Settings
from consumer.delivery import Deliverer
from consumer.intake import Intake
from consumer.logs import JsonFormatter
from consumer.metrics import DLQ_CODES, OTHER, ROUTE_ERRORS, ROUTE_LABELS, UNREGISTERED, WorkerMetrics
from consumer.registry import Registry
from consumer.route_cache import LruRouteCache
from consumer.routing import Router
from consumer.scheduler import Scheduler
from engine.store import AdapterStore
from migrations import SCRIPT_LOCATION

TP = TopicPartition("jobs", 0)
EVIL = "\x1b[31m\r\n{\"level\": \"ERROR\", \"msg\": \"forged\"}\n"  # an ANSI escape, then a forged JSON log line


@pytest.fixture
def registry(tmp_path: Path, demo_set) -> Registry:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    upgrade(url, script_location=SCRIPT_LOCATION)
    engine = make_engine(url)
    registry = Registry(session_factory(engine), AdapterStore(tmp_path / "store", max_bytes=10**8))
    registry.add_tenant("acme")
    registry.add_adapter("acme", "support", demo_set["adapters"][sorted(demo_set["adapters"])[0]])
    registry.add_rule("acme", "keyword", "refund", "support")
    yield registry
    engine.dispose()


def _hostile(i: int) -> list[bytes]:
    """Messages a producer can vary without end: each distinct per i."""
    jobs = [
        {"request_id": f"a{i}", "tenant_id": f"t{i}", "prompt": "x"},  # a tenant nobody registered
        {"request_id": f"b{i}", "tenant_id": "acme", "adapter_ref": f"ad{i}", "prompt": "x"},  # an adapter nobody has
        {"request_id": f"c{i}", "tenant_id": "acme", "adapter_ref": f"support@{i + 2}", "prompt": "x"},  # no such version
        {"request_id": f"d{i}", "tenant_id": "acme", "prompt": "x", f"bad{i}{EVIL * 50}": 1},  # unknown field, answered
        {"request_id": f"e{i}", "tenant_id": "acme", "prompt": "x", "allow_base_fallback": True, "user_id": f"u{i}"},
        {"request_id": f"f{i}", "tenant_id": "acme", "prompt": "refund", "session_id": f"s{i}"},  # a rule routes it
        {"request_id": f"g{i}", "tenant_id": "acme", "prompt": "x", "adapter_ref": "support"},
        {"request_id": f"h{i}", "tenant_id": f"t{i}{EVIL}", "prompt": "x"},  # dead-lettered: no usable tenant id
        {"request_id": f"i{i}", "prompt": "x", f"{EVIL * 2000}{i}": 1},  # dead-lettered, its field 100 kB of escapes
        {"request_id": f"j{i}", "tenant_id": "acme", "prompt": "x", "adapter_ref": f"x{EVIL}{i}"},
    ]
    return [json.dumps(j).encode() for j in jobs] + [f"{EVIL * 100}{i}".encode(), b'{"tenant_id": "acme", "request_id": "k%d", '
                                                     b'"tenant_id": "acme2"}' % i, b"\xff\xfe" + str(i).encode()]


def _run(registry: Registry, n: int) -> tuple[WorkerMetrics, list[str]]:
    metrics = WorkerMetrics()
    intake = Intake(Settings(), metrics, "w1", Scheduler(64, 100_000, 8), Router(LruRouteCache(100, 60)), None, None,
                    asyncio.Event(), registry.snapshot())
    counter = SimpleNamespace(metrics=metrics, known_tenant=lambda t: t in intake.snapshot.tenants)

    def emit(outcome) -> None:  # what Deliverer.deliver counts once an outcome is published
        if outcome.result is not None:
            Deliverer._count(counter, outcome.result)

    async def nothing_stored(keys):
        return {}

    intake.deliverer = SimpleNamespace(emit=emit)
    intake.stored = nothing_stored
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("lorabatch")
    logger.addHandler(handler)
    try:
        messages = [m for i in range(n) for m in _hostile(i)]
        items = [(TP, SimpleNamespace(topic=TP.topic, partition=0, offset=k, timestamp=1_000 + k, value=v, key=None,
                                      headers=[(f"h{k}{EVIL}", EVIL.encode())]), 1) for k, v in enumerate(messages)]
        asyncio.run(intake.ingest(items))
        intake.dlq_log.flush(force=True)
    finally:
        logger.removeHandler(handler)
    return metrics, stream.getvalue().splitlines()


def _series(metrics: WorkerMetrics) -> dict[str, set[tuple]]:
    out: dict[str, set[tuple]] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            out.setdefault(family.name, set()).add(tuple(sorted((k, v) for k, v in s.labels.items() if k != "le")))
    return out


def test_a_flood_of_distinct_values_adds_no_series(registry):
    """30 and 600 distinct tenant ids, adapter names, versions, users, sessions and unknown fields give the same series,
    each label value from its closed set: tenants registered or UNREGISTERED, adapters registered or none/base,
    reasons and DLQ codes from consumer.metrics' lists."""
    small, _ = _run(registry, 30)
    big, _ = _run(registry, 600)
    assert _series(small) == _series(big)
    series = _series(big)
    labelled = {name: {dict(labels)[key] for labels in series[name] if labels}
                for name, key in [("lora_request", "tenant"), ("lora_request_duration_seconds", "tenant"),
                                  ("lora_route_decision", "reason"), ("lorabatch_dlq", "code")] if name in series}
    assert labelled["lora_request"] <= {"acme", UNREGISTERED}
    assert {dict(labels)["adapter"] for labels in series["lora_request"] if labels} <= {"none", "base", "support@1"}
    assert labelled["lora_route_decision"] <= set(ROUTE_LABELS)
    assert labelled["lorabatch_dlq"] <= set(DLQ_CODES)
    assert len(set().union(*series.values())) < 40, series


def test_hostile_text_never_forges_or_floods_the_log(registry):
    """Fields, ids and bodies full of newlines, ANSI escapes and forged JSON lines: the log of 7,800 such messages is a
    few lines, each one JSON object, with no control character and at most a few hundred characters of the producer's."""
    _, lines = _run(registry, 600)
    assert 1 <= len(lines) <= 3, lines
    for line in lines:
        record = json.loads(line)
        assert record["logger"].startswith("lorabatch") and "forged" not in record.get("level", "")
        assert all(0x20 <= ord(c) < 0x7f for c in line), line
        assert len(line) < 2_000, len(line)


def _codes(path: str, call: str, *, arg: int | None = None) -> set[str]:
    """The string constants a file passes to `call` as its `code=` keyword or as its positional argument `arg`."""
    found = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == call:
            values = [k.value for k in node.keywords if k.arg == "code"] + (node.args[arg:arg + 1] if arg is not None else [])
            found |= {v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str)}
    return found


def test_the_closed_sets_name_every_code_the_worker_counts():
    """Every routing failure code and every DLQ code the worker's code can give is in its closed set, so none of them
    is counted as OTHER: a code added to the code must be added to consumer.metrics (and the README) too."""
    route_errors = set().union(*(_codes(f"consumer/{f}", "RouteError", arg=0) for f in ("routing.py", "intake.py")))
    assert route_errors and route_errors <= set(ROUTE_ERRORS), route_errors - set(ROUTE_ERRORS)
    rejected = (_codes("consumer/schemas.py", "ErrorInfo") | _codes("consumer/intake.py", "ErrorInfo")) - {"quota_exceeded"}
    undeliverable = _codes("consumer/delivery.py", "_undeliverable", arg=2) | _codes("consumer/delivery.py", "dead_letter", arg=0)
    assert rejected and undeliverable and rejected | undeliverable <= set(DLQ_CODES), (rejected | undeliverable) - set(DLQ_CODES)


@pytest.mark.parametrize("count, value, label", [
    ("route", "explicit", "explicit"),
    ("route", "no_adapter", "no_adapter"),
    ("route", "l3_rule (rule 7 regex)", OTHER),  # a label with its detail: one series per rule
    ("route", "", OTHER),
    ("dead_letter", "malformed_json", "malformed_json"),
    ("dead_letter", "x" * 10_000, OTHER),
    ("dead_letter", f"code{EVIL}", OTHER),
])
def test_a_value_outside_its_closed_set_is_counted_once_as_other(count, value, label):
    """A reason or DLQ code outside consumer.metrics' lists (a code added in one place and not the other, a value built
    from a job) is counted under OTHER: one series, never one per value."""
    metrics = WorkerMetrics()
    for _ in range(3):
        getattr(metrics, count)(value)
    family = "lora_route_decision" if count == "route" else "lorabatch_dlq"
    (samples,) = [[s for s in m.samples if s.name.endswith("_total")] for m in metrics.registry.collect() if m.name == family]
    assert [(next(iter(s.labels.values())), s.value) for s in samples] == [(label, 3.0)]


def test_twenty_thousand_distinct_values_leave_metrics_and_their_memory_as_they_were():
    """20,000 results, routing reasons and DLQ codes, each with a tenant id, adapter reference, reason and code of its
    own, through the counting calls the worker makes (Deliverer._count, WorkerMetrics.route and .dead_letter): the
    series after 20,000 are those after 1,000, /metrics grows by the digits of its counts only, and prometheus_client
    holds no more memory (one more series is ~1 kB)."""
    import gc
    import tracemalloc

    from prometheus_client import generate_latest

    from consumer.schemas import Cost, Result, Timings

    metrics = WorkerMetrics()
    counter = SimpleNamespace(metrics=metrics, known_tenant=lambda t: t == "acme")

    def push(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            Deliverer._count(counter, Result(request_id=f"r{i}", tenant_id=f"t{i}", status="failed", route=f"x{i}",
                                             worker_id="w"))
            Deliverer._count(counter, Result(request_id=f"s{i}", tenant_id="acme", status="succeeded", route="l1_user",
                                             worker_id="w", timings=Timings(total_ms=i % 5000),
                                             cost=Cost(routing_ms=1, lora_ms=2)))
            metrics.route(f"reason{i}")
            metrics.dead_letter(f"code{i}")

    push(0, 1_000)
    size, series = len(generate_latest(metrics.registry)), _series(metrics)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        push(1_000, 20_000)
        gc.collect()
        only = [tracemalloc.Filter(True, "*prometheus_client*")]
        grown = sum(s.size_diff for s in tracemalloc.take_snapshot().filter_traces(only).compare_to(
            before.filter_traces(only), "filename"))
    finally:
        tracemalloc.stop()
    assert _series(metrics) == series
    assert len(generate_latest(metrics.registry)) - size < 100
    assert grown < 4_096, grown
