"""A group coordinator that stops answering must not hang the worker: a commit it never answers is given up and
retried by the next one, and the exit leaves the group within a bound (a member stuck rejoining after a rebalance
storm held a SIGTERM'd worker past its minute in tests/test_chaos.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from aiokafka import TopicPartition
from aiokafka.errors import CommitFailedError

import consumer.handover as handover_module
from consumer.config import load_settings
from consumer.registry import RegistrySnapshot
from consumer.worker import Worker
from engine.config import EngineConfig

TP = TopicPartition("jobs", 0)


class _SilentCoordinator:
    """A consumer whose commit and stop wait forever (`answers` False), or fail as a fenced member's do. It is its own
    group coordinator, the part of aiokafka's that consumer.kafka.commit_in_generation commits through."""

    def __init__(self, answers: bool = False):
        self.answers = answers
        self.commits: list[dict] = []
        self.stops = 0
        self._coordinator, self.generation, self._commit_lock = self, 0, asyncio.Lock()
        self._subscription = SimpleNamespace(subscription=SimpleNamespace(assignment=SimpleNamespace(tps={TP})))

    async def ensure_coordinator_known(self):
        pass

    async def _do_commit_offsets(self, assignment, offsets):
        self.commits.append({tp: o.offset for tp, o in offsets.items()})
        if self.answers:
            raise CommitFailedError("fenced")
        await asyncio.Event().wait()

    async def stop(self):
        self.stops += 1
        await asyncio.Event().wait()


def _worker(tmp_path, consumer) -> Worker:
    s = load_settings(None, {"worker.spool_path": str(tmp_path / "spool.sqlite")})
    engine = SimpleNamespace(config=EngineConfig(max_batch_size=32))
    registry = SimpleNamespace(snapshot=lambda: RegistrySnapshot({}, {}, {}), store=SimpleNamespace(root=tmp_path))
    w = Worker(s, engine, registry, ledger=None)
    w.consumer = consumer
    w.offsets.finished(TP, 0, w.offsets.fetched(TP, 0))
    return w


async def test_a_commit_the_coordinator_never_answers_is_given_up_and_retried(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(handover_module, "COMMIT_TIMEOUT_S", 0.2)
    silent = _SilentCoordinator()
    w = _worker(tmp_path, silent)
    assert w.offsets.committable() == {TP: 1}
    with caplog.at_level(logging.WARNING, "lorabatch.worker"):
        t0 = time.monotonic()
        await w.handover.commit()
        await w.handover.commit()
    assert time.monotonic() - t0 < 2.0
    assert silent.commits == [{TP: 1}, {TP: 1}], "each commit gave up and the next tried again"
    assert w.offsets.committable() == {TP: 1}, "nothing is marked committed that the broker did not take"
    # said at the first of a run (then once every COMMIT_SAY_S), counted every time
    assert sum("no answer in" in r.getMessage() for r in caplog.records) == 1
    assert w.metrics.registry.get_sample_value("lorabatch_retries_total", {"what": "commit"}) == 2


async def test_a_fenced_commit_is_logged_and_left_for_the_next(tmp_path, caplog):
    fenced = _SilentCoordinator(answers=True)
    w = _worker(tmp_path, fenced)
    with caplog.at_level(logging.WARNING, "lorabatch.worker"):
        await w.handover.commit()
    assert w.offsets.committable() == {TP: 1}
    assert any("CommitFailedError" in r.getMessage() or "fenced" in r.getMessage() for r in caplog.records)


async def test_leaving_a_group_whose_coordinator_is_gone_ends_within_the_bound(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(handover_module, "LEAVE_TIMEOUT_S", 0.2)
    silent = _SilentCoordinator()
    w = _worker(tmp_path, silent)
    with caplog.at_level(logging.WARNING, "lorabatch.worker"):
        t0 = time.monotonic()
        await w.handover.leave()
        await w.handover.leave()  # the run's two ways out both leave; the second does nothing
    assert time.monotonic() - t0 < 2.0
    assert silent.stops == 1
    assert any("did not leave its group" in r.getMessage() for r in caplog.records)
