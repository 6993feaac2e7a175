"""Fixtures of the adversarial suite: the per-test tally (a row of the closing note's table) and an own PostgreSQL."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.adversarial.accounting import Tally, append_report
from tests.adversarial.pg_cluster import PgCluster

REPORT_ENV = "LORABATCH_ADVERSARIAL_REPORT"  # a JSON-lines file each test appends its tally to


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"_adversarial_{report.when}", report)


@pytest.fixture
def tally(request: pytest.FixtureRequest) -> Iterator[Tally]:
    """The test's counters; appended to $LORABATCH_ADVERSARIAL_REPORT (when set) whatever the outcome."""
    t = Tally(scenario=request.node.name)
    yield t
    call = getattr(request.node, "_adversarial_call", None)
    setup = getattr(request.node, "_adversarial_setup", None)
    if call is not None:
        t.outcome = call.outcome
        if call.failed and call.longrepr is not None:
            t.failure = _first_line(call)
    elif setup is not None and setup.failed:
        t.outcome = "error"
        t.failure = _first_line(setup)
    path = os.environ.get(REPORT_ENV)
    if path:
        append_report(path, t)


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PgCluster]:
    """A PostgreSQL cluster of this module's own on a free port, which its tests may stop, start and wreck."""
    cluster = PgCluster.create()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()
